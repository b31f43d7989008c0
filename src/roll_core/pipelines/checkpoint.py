"""Checkpoint directories: ``<output_dir>/checkpoints/step_000050/``.

A checkpoint is written into ``step_N.tmp-<pid>`` and renamed into place only once complete (with
``state.json`` written last), so a crash during saving never leaves a half checkpoint that resume
would pick up; the previous checkpoint stays intact, and the next save removes the leftover. Old checkpoints beyond ``keep`` are removed
after the new one is in place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointManager:
    def __init__(self, root: str | Path, keep: int = 2):
        self.root, self.keep = Path(root), keep

    def complete(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and (child / "state.json").is_file():
                found.append((int(m.group(1)), child))
        return sorted(found)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def resume_point(self) -> str:
        """Where a run stopped now would resume from, in words: for messages to the user."""
        latest = self.latest()
        return f"the last checkpoint, {latest}" if latest else "the start (no checkpoint yet)"

    def save(self, step: int, write: Callable[[Path], dict | None], state: dict) -> Path:
        """``write(tmp_dir)`` fills the checkpoint; ``state`` and the dict ``write`` may return
        become ``state.json`` (where both name a key, ``write``'s value)."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"{final.name}.tmp-{os.getpid()}"
        for stale in self.root.glob("step_*.tmp-*"):  # left by a process killed while saving
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        extra = write(tmp) or {}
        (tmp / "state.json").write_text(json.dumps({"step": step, **state, **extra}, indent=2))
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        for _, old in self.complete()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    @staticmethod
    def load_state(path: Path) -> dict:
        return json.loads((Path(path) / "state.json").read_text())
