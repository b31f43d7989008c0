"""``roll replay RUN_DIR``: train again on a run's dumped batches, without generating, and compare
each step's loss and gradient norm with those the run recorded.

To debug the training side alone (a loss, a strategy, a numerical problem) a failing step must
be reproducible without the rollout that fed it. Replay loads actor_train's weights and optimizer
from the latest checkpoint before the first step asked for, then runs the core update
(:func:`roll_core.training.update`) with the run's own objective and update settings (its pipeline's
``policy_update``: rlvr's and agentic's, or a plugin pipeline's that sets one) on each dumped
batch in order, in this process (a debugger can step into the loss), one data-parallel rank. Every
step between the checkpoint and the last step asked for must have been dumped. Run::

    roll run trainer.dump_rollouts_every=1 trainer.save_every=10
    roll replay runs/quickstart --steps 11-13

A LoRA run replays its adapters on the base the checkpoint's adapter names (the run's model, or
the warm-up folded into ``warm-model/``). The critic is not replayed, nor the updates of pipelines
without a ``policy_update`` (``online_dpo`` dumps its pairs for ``roll show-rollouts``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from roll_core.errors import RollError
from roll_core.pipelines.checkpoint import CheckpointManager
from roll_core.pipelines.rollout_dump import dumped_steps, load_dump, step_ranges
from roll_core.trackers import read_metrics

COMPARED = ("pg_loss", "grad_norm")  # under the update's metric prefix ("train/")


@dataclass
class ReplayedStep:
    step: int
    recorded: dict[str, float]
    replayed: dict[str, float]

    def gap(self, name: str) -> float | None:
        """|recorded - replayed| of ``train/<name>``; None when either lacks it."""
        key = f"train/{name}"
        if key not in self.recorded or key not in self.replayed:
            return None
        return abs(self.recorded[key] - self.replayed[key])


def parse_steps(text: str) -> tuple[int, int]:
    """``"12"`` -> ``(12, 12)``; ``"11-13"`` -> ``(11, 13)``."""
    first, _, last = text.partition("-")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        raise RollError(f"--steps '{text}': give a step (12) or a range (11-13)") from None
    if a < 1 or b < a:
        raise RollError(f"--steps '{text}': steps start at 1 and a range goes up (11-13)")
    return a, b


def plan(run_dir: Path, steps: tuple[int, int] | None) -> tuple[tuple[int, Path], list[int]]:
    """The checkpoint to start from and the steps to replay (every one after it up to the last
    asked for); default: the stretch after the latest checkpoint before the last dumped step."""
    dumped = dumped_steps(run_dir)
    if not dumped:
        raise RollError(f"{run_dir} has no rollout dumps; run with trainer.dump_rollouts_every=1 to write them")
    first, last = steps or (dumped[-1], dumped[-1])
    before = [(s, p) for s, p in CheckpointManager(Path(run_dir) / "checkpoints").complete() if s < first]
    if not before:
        raise RollError(f"{run_dir} has no checkpoint before step {first} to start from")
    start = before[-1]
    wanted = list(range(start[0] + 1, last + 1))
    if steps is None:  # from the checkpoint: the dumped steps that follow it without a gap
        wanted = [s for s in wanted if s in dumped]
        wanted = [s for i, s in enumerate(wanted) if s == start[0] + 1 + i]
    missing = [s for s in wanted if s not in dumped]
    if missing or not wanted:
        raise RollError(f"replaying up to step {last} from the checkpoint at step {start[0]} needs the dumps of "
                        f"steps {step_ranges(wanted) or start[0] + 1}; "
                        f"missing: {step_ranges(missing) or start[0] + 1} "
                        f"(dumped: {step_ranges(dumped)}; trainer.dump_rollouts_every=1 dumps every step)")
    return start, wanted


def replay(run_dir: Path, steps: tuple[int, int] | None = None, progress=print) -> list[ReplayedStep]:
    """Replay ``steps`` (a range, None: see :func:`plan`) of the run in ``run_dir``."""
    from roll_core.config.schema import RollConfig
    from roll_core.pipelines import pipeline_class
    from roll_core.plugins import get_plugins
    from roll_core.runtime.workers import TrainWorker

    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise RollError(f"{run_dir} is not a run directory: it has no config.json (roll run writes it there)")
    cfg = RollConfig.model_validate(json.loads((run_dir / "config.json").read_text()))
    plugins = get_plugins()
    policy_update = pipeline_class(cfg, plugins).policy_update
    if policy_update is None:
        raise RollError(f"roll replay replays the policy updates of pipelines {', '.join(replayable(plugins))}; "
                        f"{run_dir} ran pipeline {cfg.pipeline} (its dumps are for roll show-rollouts)")
    (start, checkpoint), wanted = plan(run_dir, steps)
    metrics_file = run_dir / "metrics.jsonl"  # none without the jsonl tracker: nothing to compare with
    recorded = {row["step"]: row for row in (read_metrics(metrics_file) if metrics_file.is_file() else [])}
    progress(f"replaying steps {step_ranges(wanted)} of {run_dir} from the checkpoint at step {start}")
    role = cfg.roles.actor_train
    worker = TrainWorker("actor_train", _start_model(checkpoint / "actor_train", role), role, cfg, cfg.seed)
    worker.setup()
    worker.load_checkpoint(str(checkpoint / "actor_train"))
    loss_fn, spec = policy_update(cfg, plugins)
    out = []
    for step in wanted:
        metrics = worker.update(load_dump(run_dir, step), loss_fn, spec)
        out.append(ReplayedStep(step, recorded.get(step, {}), metrics))
    return out


def replayable(plugins) -> list[str]:
    """The registered pipelines whose dumped batches roll replay trains again (``policy_update``)."""
    from roll_core.pipelines import pipeline_named

    # a name whose plugin fails to import, or a class without Pipeline's shape, has no policy_update
    return [name for name in plugins.pipelines.names() if pipeline_named(name, plugins).policy_update is not None]


def _start_model(saved: Path, role) -> str:
    """The model the trainer starts from before its checkpoint loads: the saved policy, or under
    LoRA the base its adapter names (the checkpoint holds the adapters and their optimizer)."""
    if role.lora is None:
        return str(saved / "model")
    from roll_core.strategies import lora

    base = lora.base_path_of(saved / "adapter")
    if not (Path(base) / "config.json").is_file():
        raise RollError(f"{saved / 'adapter'} was trained on {base}, which is not there (a relative path is "
                        f"taken from where roll run ran: run roll replay from there)")
    return base


def largest_gap(replayed: list[ReplayedStep]) -> float | None:
    """The largest gap of any compared metric at any step (None: nothing to compare)."""
    gaps = [g for r in replayed for n in COMPARED if (g := r.gap(n)) is not None]
    return max(gaps) if gaps else None


def report(replayed: list[ReplayedStep]) -> str:
    """A table: each step's recorded and replayed loss and gradient norm, and their gaps."""
    lines = [f"{'step':>6}  " + "  ".join(f"{'recorded ' + n:>20} {'replayed':>12} {'gap':>9}" for n in COMPARED)]
    for r in replayed:
        cells = []
        for name in COMPARED:
            key, gap = f"train/{name}", r.gap(name)
            rec, rep = r.recorded.get(key), r.replayed.get(key)
            cells.append(f"{'-' if rec is None else f'{rec:.6g}':>20} {'-' if rep is None else f'{rep:.6g}':>12} "
                         f"{'-' if gap is None else f'{gap:.1e}':>9}")  # '-': a side without the metric
        lines.append(f"{r.step:>6}  " + "  ".join(cells))
    largest = largest_gap(replayed)
    if largest is not None:
        lines.append(f"largest gap: {largest:.1e}")
    return "\n".join(lines)
