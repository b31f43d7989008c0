"""Metric trackers: the interface and the built-ins (``stdout``, ``jsonl``, ``tensorboard``,
``swanlab``, ``wandb``). A run uses every tracker ``trackers`` lists, at once.

Trackers receive flat ``{name: float}`` dicts with a step. Names use ``/`` to group
(``train/loss``, ``eval/accuracy``), which tensorboard, SwanLab and W&B show as sections.

A run that resumes from a checkpoint replays the steps after it. Before it does, each tracker is
told (:meth:`Tracker.rewind`) so that a step is written once: ``jsonl`` and ``tensorboard`` drop
what they hold past the checkpoint; SwanLab and W&B, which cannot take points back, write each step
once, the first time (they also start a new run per process: resumed runs continue in a new one).
"""

from __future__ import annotations

import json
import os
import sys
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from roll_core.files import write_json_lines


class Tracker(ABC):
    """Constructed as ``cls(run_dir, config)``; ``run_dir`` exists."""

    def __init__(self, run_dir: Path, config=None):
        self.run_dir, self.config = Path(run_dir), config

    @abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def rewind(self, step: int) -> None:
        """The run goes on after ``step`` (-1: from scratch): forget what was logged past it, if
        the tracker can."""

    def close(self) -> None:
        pass


def progress_bar(total: int, description: str):
    """A rich progress bar (``progress.update(task, advance=1, info=...)``) for long phases."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
    task = progress.add_task(description, total=total, info="")
    return progress, task


# Shown by the stdout tracker, in this order, when present: each built-in pipeline's headline
# metrics (a step whose metrics hold none of them prints nothing).
_STDOUT_KEYS = ("reward/mean", "episode/success_rate", "eval/accuracy", "eval/success_rate", "train/pg_loss",
                "train/kl", "train/entropy", "warmup/loss", "eval/loss", "dpo/loss", "eval/rewards/accuracy",
                "reward_model/loss", "eval/reward_model/rewards/accuracy", "distill/loss", "eval/kl_to_teacher",
                "time/step_s")


def _planned_steps(config) -> int:
    from roll_core.pipelines import pipeline_class

    return pipeline_class(config).planned_steps(config)


class StdoutTracker(Tracker):
    """The run's display on stdout: the key metrics (``_STDOUT_KEYS``) of a step and the time left.

    In a terminal, one rich progress line (step of total, ETA, the latest key metrics) updates in
    place, and every evaluation is printed above it. Piped to a file or another program, it prints a
    plain line every ``max_steps / 20`` steps, at every evaluation and at the last step, so a
    200-step run's log stays short. Without a config (a tracker built by hand), every step."""

    def __init__(self, run_dir, config=None):
        super().__init__(run_dir, config)
        self.total = _planned_steps(config) if config is not None else None
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
            if evaluated:  # above the live line; markup off, or rich would read "[step 30]" as a tag
                self.progress.console.print(f"[step {step}] {shown}", markup=False, highlight=False)
            self.progress.update(self.task, completed=step, info=shown)
            if step >= self.total:  # the run's closing lines come after the finished bar
                self.progress.stop()
                self.progress = None
        elif step % self.every == 0 or step == self.total or evaluated:
            print(f"[step {step}/{self.total}] {shown}{eta}", flush=True)

    def close(self):
        if self.progress is not None:
            self.progress.stop()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` that :class:`JsonlTracker` wrote. A last line cut short (the
    run stopped while writing it: no newline, not JSON) is left out; any other line that is not
    JSON is an error naming its line."""
    from roll_core.errors import RollError

    text = Path(path).read_text()
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines) and not text.endswith("\n"):
                continue  # torn: the next write of a resumed run replaces it (rewind)
            raise RollError(f"{path}, line {number}: not a metrics row ({exc.msg}): {line[:80]!r}") from None
    return rows


class JsonlTracker(Tracker):
    """Appends ``{"step": n, ...metrics}`` to ``<run_dir>/metrics.jsonl``; a resumed run keeps the
    lines up to its checkpoint's step and appends after them (:func:`read_metrics` reads them)."""

    def __init__(self, run_dir, config=None):
        super().__init__(run_dir, config)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = open(self.path, "a")

    def rewind(self, step):
        self._file.close()
        write_json_lines(self.path, [row for row in read_metrics(self.path) if row["step"] <= step])
        self._file = open(self.path, "a")

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

    def rewind(self, step):
        from torch.utils.tensorboard import SummaryWriter

        # TensorBoard discards the points of earlier event files at steps >= purge_step
        self._writer.close()
        self._writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=step + 1)

    def log(self, metrics, step):
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self):
        self._writer.close()


class _ForwardOnly(Tracker):
    """A service whose runs cannot take points back: each step is sent once, the first time."""

    def __init__(self, run_dir, config=None):
        super().__init__(run_dir, config)
        self.last_step = -1

    def log(self, metrics, step):
        if step > self.last_step:
            self.last_step = step
            self.send(metrics, step)

    @abstractmethod
    def send(self, metrics: dict[str, float], step: int) -> None: ...


def _run_config(config) -> dict:
    return config.model_dump(mode="json") if config is not None else {}


class SwanLabTracker(_ForwardOnly):
    """SwanLab (``pip install swanlab``), offline unless ``SWANLAB_MODE`` says otherwise: the run is
    written under ``<run_dir>/swanlab`` (``swanlab sync <that dir>/run-*`` uploads it later;
    ``swanlab[dashboard]`` shows it locally with ``SWANLAB_MODE=local``). The project is the run's
    ``exp_name``; the whole config is the run's config. SwanLab does not take over the terminal."""

    def __init__(self, run_dir, config=None):
        super().__init__(run_dir, config)
        import swanlab

        self._run = swanlab.init(
            project=config.exp_name if config is not None else "roll", name=self.run_dir.name,
            mode=os.environ.get("SWANLAB_MODE", "offline"), log_dir=str(self.run_dir / "swanlab"),
            config=_run_config(config), settings=swanlab.Settings(terminal={"proxy_type": "none"}), reinit=True)

    def send(self, metrics, step):
        self._run.log(dict(metrics), step=step)

    def close(self):
        self._run.finish()


class WandbTracker(_ForwardOnly):
    """Weights & Biases (``pip install wandb``), offline unless ``WANDB_MODE`` says otherwise: the run
    is written under ``<run_dir>/wandb`` (``wandb sync <run_dir>/wandb/offline-run-*`` uploads it
    later). The project is the run's ``exp_name``; the whole config is the run's config."""

    def __init__(self, run_dir, config=None):
        super().__init__(run_dir, config)
        import wandb

        self._run = wandb.init(project=config.exp_name if config is not None else "roll", name=self.run_dir.name,
                               mode=os.environ.get("WANDB_MODE", "offline"), dir=str(self.run_dir),
                               config=_run_config(config), reinit="create_new")

    def send(self, metrics, step):
        self._run.log(dict(metrics), step=step)

    def close(self):
        self._run.finish()
