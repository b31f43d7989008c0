"""Ray's Compiled Graphs against Ray tasks for a step's call, on a machine with few cores.

Why: a synchronous RL step sends the hybrid engine's worker one Ray task (the update, the weight
hand-over, the next generation; ``Executor.one_task_per_worker``), and on 2 cores that task's
dispatch and return cost about 3 ms a step (``ray_calls.py``). Ray's Compiled Graphs promise a call
for well under Ray's ~1 ms task launch: the graph is compiled once, and each call is written to a
shared-memory channel that a thread in the worker reads. This script measures what that does on
this machine, where the worker's thread team uses every core, so roll can decide with numbers.

An actor computes a fixed piece of work with torch on ``--threads`` threads (``--work-ms`` long on
an idle machine) and returns a quickstart-sized batch (``bench_batch_transfer.quickstart_batch``,
256 samples). The driver calls it with the same batch, alternately for ``--rounds`` rounds: as a
Ray task with no graph alive, and through a graph compiled for the round and torn down after it.
For each way it prints the medians of the worker's own compute time, the round trip beyond it, and
the CPU the driver and the worker process use per call (``time.process_time``, every thread of the
process), then how much CPU an idle worker and an idle driver use with a graph alive.

    python benchmarks/bench_compiled_graph.py [--rounds 3] [--calls 60] [--threads 2] [--work-ms 60]

Run nothing else CPU-heavy beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray


@ray.remote(num_cpus=0)
class Computer:
    """Computes for about ``work_ms`` on ``threads`` threads per call and returns the batch it got."""

    def __init__(self, threads: int, work_ms: float):
        import torch

        torch.manual_seed(0)
        torch.set_num_threads(threads)
        self.torch = torch
        self.weight = torch.randn(256, 256)
        self.steps = 1
        start = time.perf_counter()
        self.work(None)
        self.steps = max(1, round(work_ms / 1e3 / (time.perf_counter() - start)))

    def work(self, batch):
        """Returns (the batch, this call's compute seconds)."""
        start = time.perf_counter()
        x = self.torch.ones(256, 256)
        for _ in range(self.steps * 40):
            x = (x @ self.weight).tanh_()
        return batch, time.perf_counter() - start

    def cpu_seconds(self) -> float:
        return time.process_time()


def measure(call, calls: int) -> dict[str, list[float]]:
    """``call()`` ``calls`` times: the worker's compute, the round trip beyond it and the driver's CPU, ms."""
    out: dict[str, list[float]] = {"compute": [], "beyond": [], "driver_cpu": []}
    for _ in range(calls):
        cpu, start = time.process_time(), time.perf_counter()
        _, seconds = call()
        wall = time.perf_counter() - start
        out["compute"].append(seconds * 1e3)
        out["beyond"].append((wall - seconds) * 1e3)
        out["driver_cpu"].append((time.process_time() - cpu) * 1e3)
    return out


def idle_cpu(actor, seconds: float = 2.0) -> tuple[float, float]:
    """Cores the worker process and this driver use while nothing is called."""
    worker, driver = ray.get(actor.cpu_seconds.remote()), time.process_time()
    time.sleep(seconds)
    return ((ray.get(actor.cpu_seconds.remote()) - worker) / seconds, (time.process_time() - driver) / seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work-ms", type=float, default=60.0)
    args = parser.parse_args()

    from bench_batch_transfer import quickstart_batch
    from ray.dag import InputNode

    from roll_core.runtime.executor import RayExecutor

    cluster = RayExecutor()  # started as roll starts its own clusters
    actor = Computer.remote(args.threads, args.work_ms)
    batch = quickstart_batch(256)
    ray.get(actor.work.remote(batch))
    results: dict[str, dict[str, list[float]]] = {"ray task": {}, "compiled graph": {}}
    worker_cpu: dict[str, list[float]] = {"ray task": [], "compiled graph": []}
    idle = None
    for _ in range(args.rounds):
        for way in results:
            graph = None
            if way == "compiled graph":
                with InputNode() as arg:
                    node = actor.work.bind(arg)
                graph = node.experimental_compile(_submit_timeout=-1)
                ray.get(graph.execute(batch))

                def call():
                    return ray.get(graph.execute(batch), timeout=-1)
            else:
                def call():
                    return ray.get(actor.work.remote(batch))
            before = ray.get(actor.cpu_seconds.remote())
            got = measure(call, args.calls)
            worker_cpu[way].append((ray.get(actor.cpu_seconds.remote()) - before) * 1e3 / args.calls)
            for key, values in got.items():
                results[way].setdefault(key, []).extend(values)
            if graph is not None:
                idle = idle_cpu(actor)
                graph.teardown()
    quiet = idle_cpu(actor)
    cluster.shutdown()

    print(f"{args.rounds} rounds x {args.calls} calls each way, {args.threads} torch threads in the worker; "
          f"medians, ms per call")
    print(f"{'way':<16}{'worker compute':>16}{'beyond compute':>16}{'driver CPU':>12}{'worker CPU':>12}")
    for way, got in results.items():
        print(f"{way:<16}{statistics.median(got['compute']):>16.2f}{statistics.median(got['beyond']):>16.2f}"
              f"{statistics.median(got['driver_cpu']):>12.2f}{statistics.median(worker_cpu[way]):>12.1f}")
    task, graph = (statistics.median(results[w]["compute"]) for w in results)
    print(f"the same work took {graph / task:.2f}x as long with the graph alive")
    print(f"idle, cores in use: worker {quiet[0]:.2f}, driver {quiet[1]:.2f} without a graph; "
          f"worker {idle[0]:.2f}, driver {idle[1]:.2f} with one")


if __name__ == "__main__":
    main()
