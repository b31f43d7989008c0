"""What each actor call of an RL step costs on Ray, beside the same calls on the local executor.

Runs the quickstart (warm-up, then ``--steps`` RL steps, no evaluation) on the ``local`` and the
``ray`` executor in this process, alternating for ``--rounds`` rounds so drift in the machine's
speed falls on both. The driver's side is timed by wrapping the executor's ``invoke``, ``get`` and
``wait`` and the pipeline's ``step``; on Ray the workers' side comes from Ray's own task timeline
(``ray.timeline``, written just before the executor shuts down). Both clocks are the machine's
wall clock, so the two line up. On the local executor a call runs inside ``invoke``, which is all
there is to time. For each call on a step's critical path (generate, score, update) it prints
medians over the RL steps after the first:

- ``submit``: the driver inside ``.remote()`` (serialising the arguments, handing the task to Ray);
- ``dispatch``: from the start of ``.remote()`` to the worker starting the method (not counted for
  a request the step before sent ahead, ``prefetch``: it waits off the step's path);
- ``run``: the method on the worker (local: the whole call);
- ``return``: from the method's end to the driver's ``get``/``wait`` returning.

A reward role that scores in the driver (``placement``; the quickstart's ``exact_match`` does) has
no Ray call: its row shows the inline run only.

``dispatch + return`` is what a call costs beyond its own work, and ``run`` on Ray against ``run``
locally is how much slower the same work runs in a worker process. The weight hand-over is queued
behind the update and not counted.

    python benchmarks/ray_calls.py [--steps 60] [--rounds 2] [overrides ...]

Run nothing else CPU-heavy beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from step_profile import run_args  # the same quickstart run: no evaluation, no checkpoints

# (label, the driver's method name, Ray's task name on the worker)
CRITICAL = [("generate", "generate", "TrainWorker.call_hosted"),
            ("score", "score_detailed", "RewardWorker.score_detailed"),
            ("update", "update", "TrainWorker.update")]
PHASES = ("submit", "dispatch", "run", "return")


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
        RayExecutor.invoke = timed("invoke", RayExecutor.invoke, method)
        RayExecutor.get = timed("get", RayExecutor.get)
        RayExecutor.wait = timed("wait", RayExecutor.wait)
        RLVRPipeline.step = timed("step", RLVRPipeline.step, lambda step: str(step))
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


def ray_costs(events: list[tuple], timeline: list[dict]) -> dict[str, list[float]]:
    """Per RL step after the first: milliseconds of each phase of each critical call on Ray."""
    tasks = sorted((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, e["cat"].split("::", 1)[1]) for e in timeline
                   if e.get("ph") == "X" and e.get("cat", "").startswith("task::"))
    invokes = [e for e in events if e[0] == "invoke"]
    returns = sorted(e[3] for e in events if e[0] in ("get", "wait"))
    costs: dict[str, list[float]] = {}

    def add(key: str, seconds: float) -> None:
        costs.setdefault(key, []).append(seconds * 1e3)

    for _, _, start, end in [e for e in events if e[0] == "step"][1:]:
        add("step", end - start)
        for label, method, task in CRITICAL:
            # the call whose run ends in this step, and the latest submission of it before that run
            ran = next((t for t in tasks if t[2] == task and start <= t[1] <= end), None)
            sent = max((e for e in invokes if e[1] == method and ran is not None and e[2] <= ran[0]),
                       key=lambda e: e[2], default=None)
            if sent is None or ran is None:
                inline = in_process_runs(events, method, start, end)
                if inline is not None:  # in the driver (a lightweight reward): no Ray call to split
                    add(f"{label} run", inline)
                    costs.setdefault(f"{label} in the driver", []).append(1.0)
                continue
            add(f"{label} submit", sent[3] - sent[2])
            if sent[2] >= start:  # sent during the step; a prefetched request waited off the step's path
                add(f"{label} dispatch", ran[0] - sent[2])
            else:
                costs.setdefault("prefetched", []).append(1.0)
            add(f"{label} run", ran[1] - ran[0])
            back = next((r for r in returns if r >= ran[1]), None)
            if back is not None:
                add(f"{label} return", back - ran[1])
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="roll config overrides")
    args = parser.parse_args()
    from roll_core.cli import main as roll

    root = Path(tempfile.mkdtemp(prefix="roll-ray-calls-"))
    recorder = Recorder()
    recorder.install()
    costs: dict[str, dict[str, list[float]]] = {"local": {}, "ray": {}}
    for round_ in range(args.rounds):
        for executor in ("local", "ray"):
            recorder.out, recorder.events = root / f"{executor}-{round_}", []
            if roll(run_args(recorder.out, executor, args.steps, args.overrides)) != 0:
                raise SystemExit(f"the {executor} run failed")
            if executor == "ray":
                run = ray_costs(recorder.events, json.loads((recorder.out / "timeline.json").read_text()))
            else:
                run = local_costs(recorder.events)
            for key, values in run.items():
                costs[executor].setdefault(key, []).extend(values)
    local = {k: statistics.median(v) for k, v in costs["local"].items()}
    ray = {k: statistics.median(v) for k, v in costs["ray"].items()}
    print(f"\nmedians over RL steps 2-{args.steps} of {args.rounds} run(s) each, milliseconds")
    print(f"{'call':<10}{'local run':>10}" + "".join(f"{'ray ' + p:>14}" for p in PHASES))
    for label, _, _ in CRITICAL:
        print(f"{label:<10}{local.get(f'{label} run', float('nan')):>10.2f}"
              + "".join(f"{ray.get(f'{label} {p}', float('nan')):>14.2f}" for p in PHASES)
              + ("   (in the driver: run inline)" if f"{label} in the driver" in ray else ""))
    calls = sum(ray.get(f"{label} {p}", 0.0) for label, _, _ in CRITICAL for p in ("dispatch", "return"))
    slower = sum(ray.get(f"{label} run", 0.0) - local.get(f"{label} run", 0.0) for label, _, _ in CRITICAL)
    print(f"step: local {local['step']:.2f}, ray {ray['step']:.2f} (+{ray['step'] - local['step']:.2f}); "
          f"on Ray, dispatch + return {calls:.2f}, the same calls' runs {slower:+.2f}; "
          f"generate sent ahead by the step before on {len(costs['ray'].get('prefetched', []))} of "
          f"{len(costs['ray']['step'])} Ray steps")
    print(f"runs kept in {root}")


if __name__ == "__main__":
    main()
