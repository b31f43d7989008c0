"""Metric trackers: the interface and the built-ins (``stdout``, ``jsonl``, ``tensorboard``).

Trackers receive flat ``{name: float}`` dicts with a step. Names use ``/`` to group
(``train/loss``, ``eval/accuracy``), which tensorboard shows as sections.
"""

from __future__ import annotations

import json
import sys
from abc import ABC, abstractmethod
from pathlib import Path


class Tracker(ABC):
    """Constructed as ``cls(run_dir, config)``; ``run_dir`` exists."""

    def __init__(self, run_dir: Path, config=None):
        self.run_dir, self.config = Path(run_dir), config

    @abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None:
        pass


# Shown by the stdout tracker, in this order, when present.
_STDOUT_KEYS = ("reward/mean", "eval/accuracy", "train/pg_loss", "train/kl", "train/entropy",
                "warmup/loss", "time/step_s")


class StdoutTracker(Tracker):
    """One compact line per step on stdout."""

    def log(self, metrics, step):
        shown = [f"{k}={metrics[k]:.4g}" for k in _STDOUT_KEYS if k in metrics]
        if shown:
            print(f"[step {step}] " + " ".join(shown), file=sys.stdout, flush=True)


class JsonlTracker(Tracker):
    """Appends ``{"step": n, ...metrics}`` to ``<run_dir>/metrics.jsonl`` (appending keeps history across resumes)."""

    def __init__(self, run_dir, config=None):
        super().__init__(run_dir, config)
        self._file = open(self.run_dir / "metrics.jsonl", "a")

    def log(self, metrics, step):
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self):
        self._file.close()


class TensorboardTracker(Tracker):
    """Event files under ``<run_dir>/tensorboard`` (``tensorboard --logdir <run_dir>/tensorboard``)."""

    def __init__(self, run_dir, config=None):
        super().__init__(run_dir, config)
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def log(self, metrics, step):
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self):
        self._writer.close()
