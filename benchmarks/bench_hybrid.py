"""The hybrid engine's premise: the trainer and its inference engine in one process against two.

Why it matters: on Ray, the quickstart's step was 1.39x the local executor's with actor_train and
actor_infer in processes of their own (``benchmarks/step_profile.py --executor all``), and the
step's model compute itself ran slower there. ``ray.hybrid_engine`` builds actor_infer's worker
inside actor_train's process. This script isolates that effect from everything else in a step.

It captures one real ``update`` call and one real ``generate`` call, with their arguments, from
the quickstart on the local executor (warm-up, then ``--capture-step`` RL steps). It then replays
them on Ray, alternately generate and update, as a synchronous RL step does, in two layouts:

* ``one process``: both workers in one actor;
* ``two processes``: each worker in an actor of its own.

Each call is timed inside its worker, so Ray's call overhead is left out. The two layouts take
turns for ``--rounds`` rounds, and the medians of ``--calls`` pairs per round are printed.

    python benchmarks/bench_hybrid.py [--calls 40] [--rounds 3] [--capture-step 10]

Run nothing else CPU-heavy beside it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def capture(step: int, out: str, warmup_steps: int | None = None) -> dict:
    """Constructor arguments of the quickstart's train and infer workers, and the arguments of the
    update and the generate call of RL step ``step`` (the last RL step of the run in ``out``, which
    keeps the model the workers load). ``warmup_steps`` shortens the supervised warm-up before it
    (a quicker capture of a less trained policy; None: the quickstart's own)."""
    from roll_core.cli import main as roll
    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.runtime import workers

    calls: dict = {}
    in_step = [False]  # warm-up updates and evaluation's generate calls are not recorded

    def record(cls, method: str, key: str, when):
        original = getattr(cls, method)

        def wrapped(self, *args, **kwargs):
            if when():
                calls[key] = (args, kwargs)
            return original(self, *args, **kwargs)

        setattr(cls, method, wrapped)
        return cls, method, original

    def flagged_step(self, *args, **kwargs):
        in_step[0] = True
        try:
            return rl_step(self, *args, **kwargs)
        finally:
            in_step[0] = False

    rl_step = RLVRPipeline.step
    RLVRPipeline.step = flagged_step
    original_close = workers.TrainWorker.close

    def close(self):  # the run's end, before the executor frees the trainer: its weights are the policy's
        if self.role == "actor_train":
            calls["weights"] = {k: v.clone() for k, v in self.strategy.model.state_dict().items()}
        return original_close(self)

    workers.TrainWorker.close = close
    originals = [(workers.TrainWorker, "close", original_close),
                 record(workers.TrainWorker, "__init__", "train", lambda: "train" not in calls),
                 record(workers.InferWorker, "__init__", "infer", lambda: "infer" not in calls),
                 record(workers.TrainWorker, "update", "update", lambda: in_step[0]),
                 record(workers.InferWorker, "generate", "generate", lambda: in_step[0])]
    try:
        code = roll(["run", f"output_dir={out}", "executor=local", f"trainer.max_steps={step}",
                     "trainer.eval_every=0", "trainer.save_every=0", "trainer.resume=never", "trackers=[]",
                     *([f"warmup.steps={warmup_steps}"] if warmup_steps is not None else [])])
    finally:
        RLVRPipeline.step = rl_step
        for cls, method, original in originals:
            setattr(cls, method, original)
    if code != 0:
        raise SystemExit("the quickstart run failed")
    # both replayed workers start from the policy of RL step ``step`` (they load the initial model)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40, help="generate+update pairs per layout and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--capture-step", type=int, default=10, help="the RL step whose calls are replayed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        measure(capture(args.capture_step, out), args)


def measure(calls: dict, args) -> None:
    import ray

    ray.init(address="local", include_dashboard=False, logging_level="error",
             _system_config={"worker_niceness": 0})

    @ray.remote(num_cpus=0)
    class Host:
        """The workers named in ``kinds`` ("train", "infer"), built and set up in this process."""

        def __init__(self, kinds, calls):
            from roll_core.runtime.workers import InferWorker, TrainWorker

            self.calls = calls
            self.workers = {}
            for kind in kinds:
                cls = TrainWorker if kind == "train" else InferWorker
                init_args, init_kwargs = calls[kind]
                self.workers[kind] = cls(*init_args, **init_kwargs)
                self.workers[kind].setup()
                self.workers[kind].strategy.model.load_state_dict(calls["weights"])

        def timed(self, kind: str) -> float:
            worker, (call_args, call_kwargs) = self.workers[kind], self.calls["update" if kind == "train" else "generate"]
            method = worker.update if kind == "train" else worker.generate
            start = time.perf_counter()
            method(*call_args, **call_kwargs)
            return time.perf_counter() - start

    calls_ref = ray.put(calls)
    one = Host.remote(["train", "infer"], calls_ref)
    train, infer = Host.remote(["train"], calls_ref), Host.remote(["infer"], calls_ref)
    layouts = {"one process": (one, one), "two processes": (train, infer)}
    times = {name: {"update": [], "generate": []} for name in layouts}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, (t, i) in layouts.items():
            for _ in range(args.calls):
                generate = ray.get(i.timed.remote("infer"))
                update = ray.get(t.timed.remote("train"))
                if round_:
                    times[name]["generate"].append(generate)
                    times[name]["update"].append(update)
    print(f"quickstart calls of RL step {args.capture_step}, timed inside the worker; median of "
          f"{args.calls} x {args.rounds} alternating pairs per layout, seconds")
    print(f"{'layout':<16}{'update':>10}{'generate':>10}")
    medians = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    for name, m in medians.items():
        print(f"{name:<16}{m['update']:>10.4f}{m['generate']:>10.4f}")
    two, single = medians["two processes"], medians["one process"]
    print(f"two processes / one process: update {two['update'] / single['update']:.2f}x, "
          f"generate {two['generate'] / single['generate']:.2f}x")
    ray.shutdown()


if __name__ == "__main__":
    main()
