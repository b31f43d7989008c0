"""Weight-sync bandwidth: training rank 0 to the inference workers, measured side by side.

Four ways to move the same weights, in one run on one Ray cluster:

* ``collective``: what the pipeline does on Ray (``runtime.weight_sync=collective``). Training rank
  0 and every inference worker form one ``torch.distributed`` group (gloo on CPU, nccl on GPU);
  each bucket is packed into one byte buffer and broadcast, then loaded into the model.
* ``shared_memory``: the default on a one-node CPU cluster (``runtime.weight_sync=shared_memory``).
  Training rank 0 writes the buckets into a ``/dev/shm`` buffer that every inference worker maps;
  each worker loads them from there into its model.
* ``object_store``: buckets returned by the trainer into Ray's object store and passed to every
  inference worker (``runtime.weight_sync=object_store``).
* ``memcpy``: a plain in-process copy of a buffer of the same bytes (the ceiling on this machine).

Figures are weight bytes delivered to *each* inference worker per second, including packing and
loading into the model, median of ``--repeats`` syncs after one warm-up sync. The model is the
embedded Llama-architecture decoder at a chosen size (``--hidden``, ``--layers``).

    python benchmarks/bench_weight_sync.py [--hidden 1024] [--layers 8] [--infer-workers 1] [--bucket-mb 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from scratch import scratch_dir  # a temporary directory, removed at exit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--infer-workers", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import ray

    from roll_core.config import load_config
    from roll_core.embedded.model import TinyModelConfig, build_tiny_model
    from roll_core.plugins import get_plugins
    from roll_core.runtime import distributed
    from roll_core.runtime.executor import RayExecutor
    from roll_core.runtime.workers import InferWorker, TrainWorker

    shape = TinyModelConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=max(1, args.hidden // 64),
                            intermediate_size=4 * args.hidden)
    model_path = str(build_tiny_model(scratch_dir(prefix="roll-bench-") + "/model", shape))
    cfg = load_config(None, ["executor=ray", "torch_threads=1", f"runtime.weight_bucket_mb={args.bucket_mb}"])
    executor = RayExecutor(timeout_s=600)
    try:
        train = executor.spawn("actor_train", TrainWorker, [("actor_train", model_path, cfg.roles.actor_train, cfg, 0)])
        infer = executor.spawn("actor_infer", InferWorker, [("actor_infer", model_path, cfg.roles.actor_infer, cfg, 1)
                                                          for _ in range(args.infer_workers)])
        executor.get(train.call("setup") + infer.call("setup"))
        names = ("collective", "shared_memory", "object_store")
        syncs = {name: get_plugins().weight_syncs.get(name)(cfg, executor, train, infer, colocated=False)
                 for name in names}
        for sync in syncs.values():
            sync.setup()
        buckets = [b for meta in syncs["collective"].metas for b in meta]
        nbytes = sum(distributed.bucket_bytes(b) for b in buckets)

        def push(name):
            return lambda: executor.get(syncs[name].push(1))

        src, dst = torch.empty(nbytes, dtype=torch.uint8).fill_(1), torch.empty(nbytes, dtype=torch.uint8)

        def memcpy():
            dst.copy_(src)

        results = {}
        for name, fn in (("memcpy", memcpy), *((name, push(name)) for name in names)):
            fn()  # warm-up
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            results[name] = statistics.median(times)
    finally:
        executor.shutdown()
        ray.shutdown()

    gb = nbytes / 1e9
    print(f"model: hidden {args.hidden}, {args.layers} layers, {gb * 1e3:.0f} MB of weights in "
          f"{len(buckets)} bucket(s) of <= {args.bucket_mb:g} MB; {args.infer_workers} inference worker(s); "
          f"median of {args.repeats}")
    print(f"{'path':<15}{'seconds':>10}{'GB/s':>10}{'vs memcpy':>12}{'vs object_store':>18}")
    for name, seconds in results.items():
        print(f"{name:<15}{seconds:>10.3f}{gb / seconds:>10.2f}{results['memcpy'] / seconds:>11.2f}x"
              f"{results['object_store'] / seconds:>17.2f}x")


if __name__ == "__main__":
    main()
