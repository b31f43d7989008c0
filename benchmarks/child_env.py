"""The environment of a benchmark's child process: this one's, with paths put ahead on ``PYTHONPATH``.

Children import roll's code under test (``src/``, a revision's checkout, a plugin directory) ahead of
what is installed, and must still find what the machine put on ``PYTHONPATH`` itself: on a machine
without a virtual environment (a GPU machine with wheels unpacked into a directory) that is where
roll's dependencies are. Replacing ``PYTHONPATH`` instead loses them.
"""

from __future__ import annotations

import os
from pathlib import Path


def child_env(*first: str | Path, **variables: str) -> dict[str, str]:
    """``os.environ`` with ``first`` ahead of its ``PYTHONPATH`` (in order) and ``variables`` set."""
    paths = [str(p) for p in first] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, **variables, "PYTHONPATH": os.pathsep.join(paths)}
