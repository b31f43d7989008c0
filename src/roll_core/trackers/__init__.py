"""Metric trackers: the interface and the built-ins (``stdout``, ``jsonl``, ``tensorboard``).

Trackers receive flat ``{name: float}`` dicts with a step. Names use ``/`` to group
(``train/loss``, ``eval/accuracy``), which tensorboard shows as sections.
"""

from __future__ import annotations

import json
import sys
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any


class Tracker(ABC):
    """Constructed as ``cls(run_dir, config)``; ``run_dir`` exists."""

    def __init__(self, run_dir: Path, config=None):
        self.run_dir, self.config = Path(run_dir), config

    @abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None:
        pass


def progress_bar(total: int, description: str):
    """A rich progress bar (``progress.update(task, advance=1, info=...)``) for long phases."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
    task = progress.add_task(description, total=total, info="")
    return progress, task


# Shown by the stdout tracker, in this order, when present.
_STDOUT_KEYS = ("reward/mean", "eval/accuracy", "train/pg_loss", "train/kl", "train/entropy",
                "warmup/loss", "time/step_s")


class StdoutTracker(Tracker):
    """The run's display on stdout: the key metrics (``_STDOUT_KEYS``) of a step and the time left.

    In a terminal, one rich progress line (step of total, ETA, the latest key metrics) updates in
    place, and every evaluation is printed above it. Piped to a file or another program, it prints a
    plain line every ``max_steps / 20`` steps, at every evaluation and at the last step, so a
    200-step run's log stays short. Without a config (a tracker built by hand), every step."""

    def __init__(self, run_dir, config=None):
        super().__init__(run_dir, config)
        self.total = config.trainer.max_steps if config is not None else None
        self.every = max(1, self.total // 20) if self.total else 1
        self.live = sys.stdout.isatty() and bool(self.total)
        self.progress: Any = None
        self.clock: tuple[float, int] | None = None  # (time, step) of the first RL step logged

    def _eta(self, step: int) -> str:
        now = time.monotonic()
        if self.clock is None or step <= self.clock[1] or not self.total:
            self.clock = self.clock or (now, step)
            return ""
        seconds = (now - self.clock[0]) / (step - self.clock[1]) * (self.total - step)
        return f" eta {int(seconds) // 60}:{int(seconds) % 60:02d}"

    def log(self, metrics, step):
        shown = " ".join(f"{k}={metrics[k]:.4g}" for k in _STDOUT_KEYS if k in metrics)
        if not shown:
            return
        evaluated = any(k.startswith("eval/") for k in metrics)
        if not step or not self.total:  # before RL (the warm-up, the first evaluation)
            print(f"[step {step}] {shown}", flush=True)
            return
        eta = self._eta(step)
        if self.live:
            if self.progress is None:
                self.progress, self.task = progress_bar(self.total, "RL")
                self.progress.start()
            if evaluated:
                self.progress.console.print(f"[step {step}] {shown}")
            self.progress.update(self.task, completed=step, info=shown)
        elif step % self.every == 0 or step == self.total or evaluated:
            print(f"[step {step}/{self.total}] {shown}{eta}", flush=True)

    def close(self):
        if self.progress is not None:
            self.progress.stop()


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
