"""Run files written whole or not at all: a crash or a killed worker leaves the old version or the
new one, never half of either (a temporary name beside the target, then a rename, which is atomic
on one filesystem).

For what a later process reads back: the metrics a resumed run rewinds (``trackers``), rollout dumps
and exported pairs (``pipelines/rollout_dump.py``), model directories written by a warm-up or an
export. Checkpoints keep their own protocol (``pipelines/checkpoint.py``: a directory renamed into
place, then marked complete).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def write_json_lines(path: Path, rows: list[dict]) -> None:
    """``rows`` as JSON lines at ``path`` (values JSON cannot hold written as text)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row, default=str) + "\n" for row in rows))
    tmp.replace(path)


def replace_dir(src: Path, dst: Path) -> None:
    """Directory ``src``, written completely, becomes ``dst`` (a previous ``dst`` is removed first:
    a crash between the two leaves no ``dst``, which a reader takes as not written)."""
    if dst.exists():
        shutil.rmtree(dst)
    src.rename(dst)
