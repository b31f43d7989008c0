"""What each actor call of an RL step costs on Ray, beside the same calls on the local executor.

Runs the quickstart (warm-up, then ``--steps`` RL steps, no evaluation) on the ``local`` and the
``ray`` executor in this process, alternating for ``--rounds`` rounds so drift in the machine's
speed falls on both. On the local executor a call runs inside ``invoke``, which is all there is to
time. On Ray, under the hybrid engine, a step sends the update, the weight hand-over and the next
step's generation to the trainer's worker as one task (``Executor.one_task_per_worker``), so:

- each call's ``run`` is the worker's own seconds (the step's ``time/train_s`` and
  ``time/generate_s``, which the worker times inside the task); the reward, which the quickstart
  scores in the driver, is timed inside ``invoke`` as on the local executor;
- the task's ``submit`` is the driver inside the block that sends it (building the calls,
  serialising the arguments, handing the task to Ray), ``dispatch`` runs from the block's start to
  the worker starting the task, and ``return`` from the task's end to the driver's ``get``
  returning. The worker's side comes from Ray's task timeline (``ray.timeline``, written just
  before the executor shuts down); both clocks are the machine's wall clock.

``dispatch + return`` is what the step's one task costs beyond its work, and ``run`` on Ray
against ``run`` locally is how much slower the same work runs in a worker process. It prints
medians over the RL steps after the first. The Ray run keeps the controller in the driver
(``ray.colocate_controller=false``): inside the quickstart's one worker, where ``roll run`` puts it
by default, a step makes no Ray call to measure.

    python benchmarks/ray_calls.py [--steps 60] [--rounds 2] [overrides ...]

Run nothing else CPU-heavy beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

from step_profile import run_args  # the same quickstart run: no evaluation, no checkpoints
from scratch import runs_dir  # the runs' directory: --keep, or removed at exit

# (label, the driver's method name, the step metric that holds the worker's seconds on Ray)
CRITICAL = [("generate", "generate", "time/generate_s"),
            ("score", "score_detailed", None),
            ("update", "update", "time/train_s")]
TASK = "TrainWorker.run_calls"  # a step's calls to the trainer's worker, as one Ray task
PHASES = ("submit", "dispatch", "return")


class Recorder:
    """Driver events ``(kind, name, start, end)`` of the current run; on Ray, the run's timeline
    and events are written to its directory when the executor shuts down."""

    def __init__(self):
        self.events: list[tuple] = []
        self.out: Path | None = None

    def install(self) -> None:
        from roll_core.pipelines.rlvr import RLVRPipeline
        from roll_core.runtime.executor import LocalExecutor, RayExecutor

        def timed(kind, original, name_of=lambda *a: ""):
            def wrapper(executor_or_pipeline, *args):
                start = time.time()
                result = original(executor_or_pipeline, *args)
                self.events.append((kind, name_of(*args), start, time.time()))
                return result
            return wrapper

        def method(handle, name, args, kwargs):
            return name

        # a call the local executor runs (every call of a local run; on Ray, a reward role that
        # scores in the driver) is timed whole, inside invoke
        LocalExecutor.invoke = timed("run", LocalExecutor.invoke, method)
        RayExecutor.get = timed("get", RayExecutor.get)
        RLVRPipeline.step = timed("step", RLVRPipeline.step, lambda step: str(step))
        block = RayExecutor.one_task_per_worker

        @contextlib.contextmanager
        def timed_block(executor):
            start = time.time()
            with block(executor):
                yield
            self.events.append(("block", "", start, time.time()))

        RayExecutor.one_task_per_worker = timed_block
        shutdown = RayExecutor.shutdown

        def dump_then_shutdown(executor):
            executor.ray.timeline(str(self.out / "timeline.json"))
            shutdown(executor)

        RayExecutor.shutdown = dump_then_shutdown


def in_process_runs(events: list[tuple], method: str, start: float, end: float) -> float | None:
    """Seconds of the calls of ``method`` the local executor ran between ``start`` and ``end``."""
    runs = [e[3] - e[2] for e in events if e[0] == "run" and e[1] == method and start <= e[2] <= end]
    return sum(runs) if runs else None


def local_costs(events: list[tuple]) -> dict[str, list[float]]:
    """Per RL step after the first: milliseconds of each critical call, run inside ``invoke``."""
    costs: dict[str, list[float]] = {}
    for _, _, start, end in [e for e in events if e[0] == "step"][1:]:
        costs.setdefault("step", []).append((end - start) * 1e3)
        for label, method, _ in CRITICAL:
            run = in_process_runs(events, method, start, end)
            if run is not None:
                costs.setdefault(f"{label} run", []).append(run * 1e3)
    return costs


def ray_costs(events: list[tuple], timeline: list[dict], rows: list[dict]) -> dict[str, list[float]]:
    """Per RL step after the first: milliseconds of the step's one task to the trainer's worker and
    of each critical call's run on Ray (``rows``: the run's step metrics)."""
    tasks = sorted((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in timeline
                   if e.get("ph") == "X" and e.get("cat", "") == f"task::{TASK}")
    blocks = [e for e in events if e[0] == "block"]
    returns = sorted(e[3] for e in events if e[0] == "get")
    metrics = {r["step"]: r for r in rows}
    costs: dict[str, list[float]] = {}

    def add(key: str, seconds: float) -> None:
        costs.setdefault(key, []).append(seconds * 1e3)

    for _, step, start, end in [e for e in events if e[0] == "step"][1:]:
        add("step", end - start)
        for label, method, metric in CRITICAL:
            if metric is not None:
                add(f"{label} run", metrics[int(step)][metric])
            else:  # in the driver (a lightweight reward): no Ray call
                inline = in_process_runs(events, method, start, end)
                if inline is not None:
                    add(f"{label} run", inline)
        # the block this step sent, the task it started and the get that returned its results
        sent = next((b for b in blocks if start <= b[2] <= end), None)
        ran = next((t for t in tasks if sent is not None and t[0] >= sent[2]), None)
        if sent is None or ran is None:
            continue
        add("task submit", sent[3] - sent[2])
        add("task dispatch", ran[0] - sent[2])
        back = next((r for r in returns if r >= ran[1]), None)
        if back is not None:
            add("task return", back - ran[1])
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="keep the runs' directories here")
    parser.add_argument("overrides", nargs="*", help="roll config overrides")
    args = parser.parse_args()
    from roll_core.cli import main as roll

    root = runs_dir(args.keep, "roll-ray-calls-")
    recorder = Recorder()
    recorder.install()
    costs: dict[str, dict[str, list[float]]] = {"local": {}, "ray": {}}
    for round_ in range(args.rounds):
        for executor in ("local", "ray"):
            recorder.out, recorder.events = root / f"{executor}-{round_}", []
            # on Ray the controller stays in the driver: with it inside the worker a step makes no call
            driver = ["ray.colocate_controller=false"] if executor == "ray" else []
            if roll(run_args(recorder.out, executor, args.steps, [*args.overrides, *driver])) != 0:
                raise SystemExit(f"the {executor} run failed")
            if executor == "ray":
                rows = [json.loads(line) for line in (recorder.out / "metrics.jsonl").read_text().splitlines()]
                run = ray_costs(recorder.events, json.loads((recorder.out / "timeline.json").read_text()),
                                [r for r in rows if "time/step_s" in r])
            else:
                run = local_costs(recorder.events)
            for key, values in run.items():
                costs[executor].setdefault(key, []).extend(values)
    local = {k: statistics.median(v) for k, v in costs["local"].items()}
    ray = {k: statistics.median(v) for k, v in costs["ray"].items()}
    print(f"\nmedians over RL steps 2-{args.steps} of {args.rounds} run(s) each, milliseconds")
    print(f"{'call':<10}{'local run':>10}{'ray run':>10}")
    for label, _, _ in CRITICAL:
        print(f"{label:<10}{local.get(f'{label} run', float('nan')):>10.2f}{ray.get(f'{label} run', float('nan')):>10.2f}")
    print("the step's one task on Ray (update, weight hand-over, next generation): "
          + ", ".join(f"{p} {ray.get(f'task {p}', float('nan')):.2f}" for p in PHASES))
    calls = ray.get("task dispatch", 0.0) + ray.get("task return", 0.0)
    slower = sum(ray.get(f"{label} run", 0.0) - local.get(f"{label} run", 0.0) for label, _, _ in CRITICAL)
    print(f"step: local {local['step']:.2f}, ray {ray['step']:.2f} (+{ray['step'] - local['step']:.2f}); "
          f"on Ray, dispatch + return {calls:.2f}, the same calls' runs {slower:+.2f}, "
          f"the rest {ray['step'] - local['step'] - calls - slower:+.2f}; "
          f"a task on {len(costs['ray'].get('task dispatch', []))} of {len(costs['ray']['step'])} Ray steps")
    if args.keep:
        print(f"runs kept in {root}")


if __name__ == "__main__":
    main()
