"""Where an RL update's time goes, and how close its matrix products run to the machine's own speed.

One ``hf`` trainer makes GRPO updates (the clipped loss, one optimizer step) on the batch of
``bench_packing.py`` (8 prompts x 8 samples; at ``--size large`` the 95M model of ``large_model.py``
with responses of up to 64 tokens, as ``vs_trl.py`` trains it), timed over ``--rounds`` after a
warm-up. A torch profile of one more update then counts the floating-point operations of every
matrix product from its shapes and prints:

* the products' time, their GFLOP and speed, against a square ``torch.mm`` timed in the same run
  (the speed this machine's kernels reach at all) and against ``6 x parameters x positions``, what
  a forward and backward pass must compute (above 1x: products the update did not need);
* the other operators that took the most time.

The process keeps freed memory as roll's CPU workers do (``runtime.reuse_freed_memory``), so the
update is the one a run makes; ``--glibc-default`` leaves glibc's allocator as it is, where every
pass faults its activations in again and the elementwise operators pay for it.

    python benchmarks/profile_update.py --size large --rounds 2     # about 2 minutes on 2 cores

Run nothing else CPU-heavy beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench_packed_attention import build, device_label, timed
from bench_packing import rl_batch, tokens_computed
from scratch import scratch_dir  # a temporary directory, removed at exit

PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")


def product_flops(name: str, shapes: list) -> int:
    """Floating-point operations of one call of a matrix-product operator, from its input shapes."""
    if name == "aten::mm":
        (m, k), (_, n) = shapes[0], shapes[1]
        return 2 * m * k * n
    if name == "aten::addmm":  # (bias, a, b)
        (m, k), (_, n) = shapes[1], shapes[2]
        return 2 * m * k * n
    if name == "aten::bmm":
        (b, m, k), (_, _, n) = shapes[0], shapes[1]
        return 2 * b * m * k * n
    rows = 1
    for size in shapes[0][:-1]:  # oneDNN's linear: input [..., K], weight [N, K]
        rows *= size
    (n, k) = shapes[1]
    return 2 * rows * k * n


def square_mm_gflops(size: int = 2048, repeats: int = 5) -> float:
    """The speed of a large square fp32 product on this machine, best of ``repeats``."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = min(timed(lambda: torch.mm(a, b))[0] for _ in range(repeats))
    return 2 * size ** 3 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=["tiny", "large"], default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--top", type=int, default=8, help="other operators to list")
    parser.add_argument("--glibc-default", action="store_true",
                        help="do not keep freed memory (runtime.reuse_freed_memory=false)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if not args.glibc_default:
        from roll_core.runtime.host_memory import keep_freed_memory

        keep_freed_memory()

    from roll_core.algorithms.objective import ActorObjective
    from roll_core.config.schema import AlgorithmConfig, TrainRoleConfig
    from roll_core.pipelines.runtime import load_tokenizer
    from roll_core.strategies.hf import HFTrainStrategy
    from roll_core.training import UpdateSpec, update

    large = args.size == "large"
    path = build(args.size, Path(scratch_dir()))
    batch = rl_batch(load_tokenizer(path), 8, 64 if large else 8, 48.0 if large else 4.0, 0)
    positions = tokens_computed(batch, {"pack_sequences": True, "micro_batch_size": 64})  # the update's one pass
    trainer = HFTrainStrategy(path, TrainRoleConfig(pack_sequences=True, micro_batch_size=64), seed=0)
    parameters = sum(p.numel() for p in trainer.model.parameters())
    objective, spec = ActorObjective.from_config(AlgorithmConfig()), UpdateSpec(max_grad_norm=1.0, micro_batch_size=64)
    print(f"{device_label()}, torch {torch.__version__}, {args.size}: {parameters / 1e6:.1f}M parameters, "
          f"{len(batch)} samples packed into {positions} positions; freed memory "
          f"{'returned to the kernel (glibc default)' if args.glibc_default else 'kept'}", flush=True)

    seconds = [timed(lambda: update(trainer, batch, objective, spec))[0] for _ in range(args.rounds + 1)][1:]
    peak = square_mm_gflops()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        update(trainer, batch, objective, spec)
        profiled = time.perf_counter() - start

    product_s = flops = 0.0
    others: dict[str, float] = {}
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key in PRODUCTS:
            product_s += event.self_cpu_time_total / 1e6
            flops += product_flops(event.key, event.input_shapes) * event.count
        else:
            others[event.key] = others.get(event.key, 0.0) + event.self_cpu_time_total / 1e6
    needed = 6 * parameters * positions
    print(f"update: {statistics.median(seconds):.3f} s (median of {args.rounds}); under the profiler {profiled:.3f} s")
    print(f"matrix products: {product_s:.3f} s, {flops / 1e9:.1f} GFLOP at {flops / product_s / 1e9:.0f} GFLOP/s; "
          f"a square torch.mm here: {peak:.0f} GFLOP/s ({flops / product_s / 1e9 / peak:.0%} of it)")
    print(f"products' GFLOP / (6 x parameters x positions): {flops / needed:.3f}x")
    print("other operators, self time:")
    for name, s in sorted(others.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {name:60s} {s:7.3f} s")


if __name__ == "__main__":
    main()
