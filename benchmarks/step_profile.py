"""Where an RL step of the embedded default goes: time per phase, model compute against overhead,
and what the Ray executor adds over the local one.

Runs ``roll run`` (the quickstart: warm-up, then ``--steps`` RL steps, no evaluation) on the
``local`` executor in this process and on the ``ray`` executor in a child process, alternating for
``--rounds`` rounds so drift in the machine's speed falls on both, and prints the median of each
``time/*`` phase over the RL steps after the first of every run.

On the local executor every role runs in this process, so the script also times what counts as
model compute: the causal LM's forward passes, backward passes, gradient clipping and optimizer
steps, and whole
``generate`` calls (the sampling loop around the model included). Everything else in a step,
(batching, packing, rewards, advantages, the pipeline's bookkeeping) is overhead. On Ray the
workers are other processes; a Ray step does the same compute, so what it takes beyond the local
step is the executor's cost (calls, serialisation, the weight broadcast). By default Ray builds
actor_infer's worker inside actor_train's process (``ray.hybrid_engine``) and, that process hosting
every role, runs the pipeline's controller there too (``ray.colocate_controller``); ``--executor
all`` also runs Ray with the controller in the driver (``ray-driver``) and with a process per role
(``ray-separate``). Ratios compare ``time/iteration_s``, a step's
wall time as the run goes (the loop's logging included); ``time/step_s`` leaves out what the hybrid
engine generates before a step starts.

    python benchmarks/step_profile.py [--steps 100] [--rounds 2] [--executor both|all|local|ray] [overrides ...]
    python benchmarks/step_profile.py --size large --steps 4 --rounds 2

Both ratios move with the machine: some hosts run a whole process in a fast or a slow mode, tens of
percent apart, so the script also prints what each executor spends per step outside training and
generation (as the run timed them), and Ray's iteration at the local run's compute speed.

``--size large`` profiles the step ``vs_trl.py`` compares at its large size: the 95M-parameter model
of ``large_model.py`` (random weights, no warm-up), 8 prompts x 8 samples of up to 64 tokens, one
training pass over the step's samples.

Run nothing else CPU-heavy beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from scratch import runs_dir  # the runs' directory: --keep, or removed at exit

# Ray runs per --executor choice: the default layout (on the quickstart, the controller inside the one
# worker that hosts every role), and with "all" also the controller in the driver
# (ray.colocate_controller=false) and actor_infer in a process of its own (ray.hybrid_engine=false),
# so the effect of each is measured in the same invocation.
RAY_LAYOUTS = {"local": [], "ray": [("ray", [])], "both": [("ray", [])],
               "all": [("ray", []), ("ray-driver", ["ray.colocate_controller=false"]),
                       ("ray-separate", ["ray.hybrid_engine=false"])]}
RAY_NAMES = ("ray", "ray-driver", "ray-separate")
# time/iteration_s: from one step's end to the next one's, the loop's logging included (under the
# hybrid engine part of a step's generation runs before its time/step_s starts): the headline number
PHASES = ("time/iteration_s", "time/step_s", "time/rollout_s", "time/generate_s", "time/train_s",
          "time/weight_sync_s")


class ComputeClock:
    """Seconds spent in model compute, per RL step (``marks`` cut the running total at each step)."""

    def __init__(self):
        self.total = 0.0
        self.depth = 0  # a forward pass inside generate (or a nested module call) counts once

    @contextmanager
    def timing(self):
        self.depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.total += time.perf_counter() - start

    def wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)
        clock = self

        def timed(*args, **kwargs):
            with clock.timing():
                return original(*args, **kwargs)

        setattr(owner, name, timed)


def install_clock() -> tuple[ComputeClock, list[float]]:
    """Time the causal LM's forward, backward, optimizer steps and ``generate`` calls; record the
    running total at the end of each RL step."""
    import torch
    from transformers import PreTrainedModel

    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.strategies.hf import HFInferStrategy

    clock, marks = ComputeClock(), []
    original_call = PreTrainedModel.__call__

    def timed_call(self, *args, **kwargs):  # the whole model, not each of its modules
        with clock.timing():
            return original_call(self, *args, **kwargs)

    PreTrainedModel.__call__ = timed_call
    clock.wrap(torch.Tensor, "backward")
    clock.wrap(torch.optim.AdamW, "step")
    clock.wrap(torch.nn.utils, "clip_grad_norm_")
    clock.wrap(HFInferStrategy, "generate")
    original_step = RLVRPipeline.step

    def marked_step(self, *args, **kwargs):
        result = original_step(self, *args, **kwargs)
        marks.append(clock.total)
        return result

    RLVRPipeline.step = marked_step
    return clock, marks


def run_args(out: Path, executor: str, steps: int, overrides: list[str]) -> list[str]:
    return ["run", f"output_dir={out}", f"executor={executor}", f"trainer.max_steps={steps}", "trainer.eval_every=0",
            "trainer.save_every=0", "trainer.resume=never", "trackers=[jsonl]", *overrides]


def step_rows(out: Path) -> list[dict]:
    """The metrics of every RL step after the first."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step_s" in r][1:]


def phases(steps: list[dict]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in steps) for k in PHASES if all(k in r for r in steps)}


def outside_compute(phase: dict[str, float]) -> float:
    """The median iteration less the median training and generation, as the run timed them: what the
    executor and the pipeline add around the model's work. Medians of each phase, not of each step's
    difference: under the hybrid engine an iteration holds one step's update and the next step's
    generation, so a step's own generation seconds belong to the iteration before it."""
    return phase["time/iteration_s"] - phase["time/train_s"] - phase.get("time/generate_s", 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="keep the runs' directories here")
    parser.add_argument("--executor", choices=["both", "all", "local", "ray"], default="both")
    parser.add_argument("--size", choices=["tiny", "large"], default="tiny")
    parser.add_argument("overrides", nargs="*", help="roll config overrides")
    args = parser.parse_args()
    root = runs_dir(args.keep, "roll-step-profile-")
    if args.size == "large":
        from large_model import build_large_model

        args.overrides = [f"model.path={build_large_model(root)}", "warmup.steps=0", "rollout.prompts_per_step=8",
                          "rollout.num_return_sequences=8", "rollout.max_new_tokens=64",
                          "roles.actor_train.micro_batch_size=64", "data.eval_size=8", *args.overrides]
    steps: dict[str, list[dict]] = {}
    rounds: dict[str, list[float]] = {}  # each run's median step, by layout: the spread between rounds
    computed: list[float] = []
    with_local = args.executor in ("both", "all", "local")
    clock_marks = install_clock()[1] if with_local else []
    for round_ in range(args.rounds):
        if with_local:
            from roll_core.cli import main as roll

            clock_marks.clear()
            out = root / f"local-{round_}"
            if roll(run_args(out, "local", args.steps, args.overrides)) != 0:
                raise SystemExit("the local run failed")
            computed += [b - a for a, b in zip(clock_marks, clock_marks[1:])]  # steps 2.. (as step_rows)
            steps.setdefault("local", []).extend(step_rows(out))
            rounds.setdefault("local", []).append(phases(step_rows(out))["time/iteration_s"])
        for name, extra in RAY_LAYOUTS[args.executor]:
            out = root / f"{name}-{round_}"
            cmd = [sys.executable, "-m", "roll_core.cli", *run_args(out, "ray", args.steps, [*args.overrides, *extra])]
            if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:
                raise SystemExit(f"the Ray run failed: {' '.join(cmd)}")
            steps.setdefault(name, []).extend(step_rows(out))
            rounds.setdefault(name, []).append(phases(step_rows(out))["time/iteration_s"])
    results = {name: phases(rows) for name, rows in steps.items()}
    compute = statistics.median(computed) if computed else None
    print(f"\nmedians over RL steps 2-{args.steps} of {args.rounds} run(s) each, seconds")
    print(f"{'phase':<20}" + "".join(f"{name:>14}" for name in results))
    for key in PHASES:
        print(f"{key:<20}" + "".join(f"{r.get(key, float('nan')):>14.4f}" for r in results.values()))
    if compute is not None:
        step = results["local"]["time/iteration_s"]
        print(f"local: model compute {compute:.4f} s of a {step:.4f} s iteration ({compute / step:.0%}); "
              f"overhead {step - compute:.4f} s ({1 - compute / step:.0%})")
    if "ray" in results and "local" in results:
        ray, local = results["ray"]["time/iteration_s"], results["local"]["time/iteration_s"]
        for name in [n for n in RAY_NAMES if n in results]:
            each = " ".join(f"{a / b:.2f}x" for a, b in zip(rounds[name], rounds["local"]))
            step_ratio = results[name]["time/step_s"] / results["local"]["time/step_s"]
            print(f"{name} / local iteration time: {results[name]['time/iteration_s'] / local:.2f}x "
                  f"(round by round: {each}); step time {step_ratio:.2f}x")
        if compute is not None:
            print(f"ray: model compute (as local) {compute / ray:.0%} of the step; overhead {1 - compute / ray:.0%}")
        # A whole run computes in a fast or a slow mode of the machine (docs/benchmarks.md), which moves the
        # ratio above by tens of percent; the time around the model's work does not depend on it.
        rest = {name: outside_compute(phase) for name, phase in results.items()}
        print("outside training and generation, per step: "
              + ", ".join(f"{name} {seconds * 1000:.1f} ms" for name, seconds in rest.items()))
        for name in [n for n in RAY_NAMES if n in results]:
            added = rest[name] - rest["local"]
            print(f"{name} adds {added * 1000:.1f} ms per step: {(local + added) / local:.2f}x the local iteration "
                  "at the same compute speed")
    if args.keep:
        print(f"runs kept in {root}")


if __name__ == "__main__":
    main()
