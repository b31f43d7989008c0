"""What each Ray actor call of an RL step costs: submission, dispatch, the worker's run, the return.

Runs the quickstart (warm-up, then ``--steps`` RL steps, no evaluation) on the ``ray`` executor in
this process. The driver's side is timed by wrapping the executor's ``invoke``, ``get`` and ``wait``
and the pipeline's ``step``; the workers' side comes from Ray's own task timeline
(``ray.timeline``), written just before the executor shuts down. Both clocks are the machine's wall
clock, so the two line up. For every call on a step's critical path (generate, score, update) it
prints medians over the RL steps after the first:

- ``submit``: the driver inside ``.remote()`` (serialising the arguments, handing the task to Ray);
- ``dispatch``: from the start of ``.remote()`` to the worker starting the method;
- ``run``: the method on the worker;
- ``return``: from the method's end to the driver's ``get``/``wait`` returning.

``dispatch + return`` is what the call costs beyond its own work; the local executor pays none of it.
The weight hand-over is not on the critical path (it is queued behind the update) and is not counted.

    python benchmarks/ray_calls.py [--steps 60] [overrides ...]

Run nothing else CPU-heavy beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

# (label, the driver's method name, Ray's task name on the worker)
CRITICAL = [("generate", "generate", "TrainWorker.call_hosted"),
            ("score", "score_detailed", "RewardWorker.score_detailed"),
            ("update", "update", "TrainWorker.update")]


def instrument(out: Path) -> list[tuple]:
    """Record driver events ``(kind, name, start, end)``; dump them and Ray's timeline at shutdown."""
    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.runtime.executor import RayExecutor

    events: list[tuple] = []

    def timed(kind, original, name_of=lambda *a: ""):
        def wrapper(self, *args):
            start = time.time()
            result = original(self, *args)
            events.append((kind, name_of(*args), start, time.time()))
            return result
        return wrapper

    def method_name(handle, method, args, kwargs):
        return args[1] if method == "call_hosted" else method  # a hosted worker's call: (role, method, ...)

    RayExecutor.invoke = timed("invoke", RayExecutor.invoke, method_name)
    RayExecutor.get = timed("get", RayExecutor.get)
    RayExecutor.wait = timed("wait", RayExecutor.wait)
    RLVRPipeline.step = timed("step", RLVRPipeline.step, lambda step: str(step))
    shutdown = RayExecutor.shutdown

    def dump_then_shutdown(self):
        self.ray.timeline(str(out / "timeline.json"))
        (out / "driver.json").write_text(json.dumps(events))
        shutdown(self)

    RayExecutor.shutdown = dump_then_shutdown
    return events


def call_costs(out: Path) -> dict[str, list[float]]:
    """Per RL step after the first: milliseconds of each phase of each critical-path call."""
    timeline = json.loads((out / "timeline.json").read_text())
    events = json.loads((out / "driver.json").read_text())
    tasks = sorted((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, e["cat"].split("::", 1)[1]) for e in timeline
                   if e.get("ph") == "X" and e.get("cat", "").startswith("task::"))
    steps = [(start, end) for kind, _, start, end in events if kind == "step"][1:]
    costs: dict[str, list[float]] = {}

    def add(key: str, seconds: float) -> None:
        costs.setdefault(key, []).append(seconds * 1e3)

    for start, end in steps:
        add("step", end - start)
        invokes = [e for e in events if e[0] == "invoke" and start <= e[2] <= end]
        returns = [e[3] for e in events if e[0] in ("get", "wait") and start <= e[2] <= end]
        for label, method, task in CRITICAL:
            sent = next((e for e in invokes if e[1] == method), None)
            ran = next((t for t in tasks if t[2] == task and sent is not None and t[0] >= sent[2]), None)
            if sent is None or ran is None:
                continue
            back = min((r for r in returns if r >= ran[1]), default=None)
            add(f"{label} submit", sent[3] - sent[2])
            add(f"{label} dispatch", ran[0] - sent[2])
            add(f"{label} run", ran[1] - ran[0])
            if back is not None:
                add(f"{label} return", back - ran[1])
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("overrides", nargs="*", help="roll config overrides")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="roll-ray-calls-"))
    instrument(out)
    from roll_core.cli import main as roll

    if roll(["run", f"output_dir={out}", "executor=ray", f"trainer.max_steps={args.steps}", "trainer.eval_every=0",
             "trainer.save_every=0", "trainer.resume=never", "trackers=[jsonl]", *args.overrides]) != 0:
        raise SystemExit("the run failed")
    costs = call_costs(out)
    median = {k: statistics.median(v) for k, v in costs.items()}
    print(f"\nmedians over RL steps 2-{args.steps}, milliseconds")
    print(f"{'call':<10}{'submit':>9}{'dispatch':>10}{'run':>9}{'return':>9}")
    for label, _, _ in CRITICAL:
        print(f"{label:<10}" + "".join(f"{median.get(f'{label} {p}', float('nan')):>{w}.2f}"
                                       for p, w in (("submit", 9), ("dispatch", 10), ("run", 9), ("return", 9))))
    overhead = sum(median.get(f"{label} {p}", 0.0) for label, _, _ in CRITICAL for p in ("dispatch", "return"))
    print(f"step {median['step']:.2f} ms; dispatch + return of these calls {overhead:.2f} ms "
          f"({overhead / median['step']:.0%} of the step)")
    print(f"run kept in {out}")


if __name__ == "__main__":
    main()
