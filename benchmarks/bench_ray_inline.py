"""Ray's inline cut: a batch's round trip inside Ray's task messages against through its object store.

Why it matters: Ray carries a task's argument or result inside its messages up to
``max_direct_call_object_size`` (100 KiB by default) and puts anything larger into its shared-memory
object store, which costs a put, a notification and a read on the other side. An RL step's batch on a
small model sits just above that cut (the quickstart update's batch pickles to about 113 KB), so
every step paid the store's fixed cost. roll starts its own clusters with the cut at
``roll_core.runtime.executor.RAY_INLINE_BYTES``; this script measures both cuts, side by side.

Each cut needs a cluster of its own (Ray reads its system config at start-up), started by roll's
``RayExecutor`` with ``RAY_INLINE_BYTES`` set to the cut, so each runs in a child process,
alternating for ``--rounds`` rounds; every child sends a roll ``Batch`` of the quickstart's shape
(``bench_batch_transfer.quickstart_batch``) at several sample counts to an actor that returns it,
and prints the median round trip per size.

    python benchmarks/bench_ray_inline.py [--rounds 3] [--calls 100] [--samples 128 256 512 1024 2048]

Run nothing else CPU-heavy beside it.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
import time

RAY_DEFAULT_BYTES = 100 * 1024  # Ray's own max_direct_call_object_size


def child(limit: int, samples: list[int], calls: int) -> None:
    """One cluster, started as roll starts its own but with the given cut; prints
    ``{samples: [bytes, ms]}`` as JSON."""
    import ray
    import torch
    from bench_batch_transfer import quickstart_batch

    from roll_core.runtime import executor

    executor.RAY_INLINE_BYTES = limit
    cluster = executor.RayExecutor()

    @ray.remote(num_cpus=0)
    class Echo:
        def back(self, payload):
            return payload

    echo = Echo.remote()
    out = {}
    for n in samples:
        batch = quickstart_batch(n)
        ray.get(echo.back.remote(batch))
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            back = ray.get(echo.back.remote(batch))
            times.append(time.perf_counter() - start)
        assert torch.equal(back.tensors["responses"], batch["responses"])
        out[n] = [len(pickle.dumps(batch, protocol=5)), statistics.median(times) * 1e3]
    cluster.shutdown()
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--samples", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # the cut in bytes
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.samples, args.calls)
        return
    from roll_core.runtime.executor import RAY_INLINE_BYTES

    cuts = {"ray default (100 KiB)": RAY_DEFAULT_BYTES, f"roll ({RAY_INLINE_BYTES // 1024} KiB)": RAY_INLINE_BYTES}
    runs: dict[str, list[dict]] = {name: [] for name in cuts}
    for _ in range(args.rounds):
        for name, cut in cuts.items():
            cmd = [sys.executable, __file__, "--child", str(cut), "--calls", str(args.calls),
                   "--samples", *map(str, args.samples)]
            result = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(result.stdout.strip().splitlines()[-1]))
    default, roll = (runs[name] for name in cuts)
    print(f"median round trip (argument and result) over {args.rounds} rounds x {args.calls} calls, ms")
    print(f"{'samples':>8}{'pickled KB':>12}" + "".join(f"{name:>24}" for name in cuts) + f"{'ratio':>8}")
    for n in map(str, args.samples):
        size = default[0][n][0] / 1000
        a = statistics.median(r[n][1] for r in default)
        b = statistics.median(r[n][1] for r in roll)
        print(f"{n:>8}{size:>12.0f}{a:>24.2f}{b:>24.2f}{a / b:>7.2f}x")


if __name__ == "__main__":
    main()
