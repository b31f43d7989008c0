"""Scratch directories for the benchmarks, removed when the benchmark exits.

A benchmark's runs write models and checkpoints: one 95M roll run in ``vs_trl.py`` leaves 1.5 GB of
checkpoints, so directories left in the temp folder fill a disk after a few invocations. Each
benchmark takes its directories from here instead of ``tempfile.mkdtemp``; they go on a normal exit,
an exception, Ctrl-C or SIGTERM (a ``kill``, a CI's timeout), not on SIGKILL.
"""

from __future__ import annotations

import atexit
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path


def _exit_on_sigterm() -> None:
    """SIGTERM ends the process as an exception would, so ``atexit`` runs (Python's default dies at
    once); a handler someone else installed is left alone."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def scratch_dir(prefix: str = "roll-bench-") -> str:
    """A new directory (a ``str``, like ``tempfile.mkdtemp``) deleted with its contents at exit."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    _exit_on_sigterm()
    return path


def runs_dir(keep: Path | str | None, prefix: str) -> Path:
    """Where a benchmark writes its runs: ``keep`` (its ``--keep``), created and left in place, or
    else a :func:`scratch_dir`."""
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        return Path(keep)
    return Path(scratch_dir(prefix=prefix))
