"""Decoding on CPU with each weight packed once per generate call, against torch's plain ``F.linear``.

A decoding step multiplies a few dozen rows by every weight of the model. torch's default fp32
kernel on CPU (MKL's sgemm) first reorders the weight into the layout its inner loop reads, at every
call; with few rows that reordering is a large share of the product. roll's hf engine reorders each
large weight once per generate call instead (``runtime.pack_decoding_weights``,
:func:`roll_core.strategies.cpu_matmul.packed_for_decoding`), for MKL's kernel or, on AMD CPUs,
oneDNN's (:func:`~roll_core.strategies.cpu_matmul.packing_kernel`). This script shows what each gains
on the machine it runs on, side by side, in two parts:

1. *products*: the 95M model's three weight shapes (hidden 768, MLP 3072) at decoding's row counts,
   ``F.linear`` against each kernel's packed copy, alternating, the median of ``--rounds``; plus the
   time to pack each weight, which a generate call pays once;
2. *generate calls*: roll's hf engine generating ``vs_trl.py``'s large step (8 prompts x 8 samples,
   up to 64 new tokens) with packing off and on each kernel, alternating, the same seed each call (so
   the same draws), the first round not counted. It checks that all sample the same tokens and
   reports how far their log-probs are apart.

    python benchmarks/bench_packed_decoding.py [--rounds 5] [--cpu-matmul torch]

Packing applies to layers on torch's kernel: where ``runtime.cpu_matmul`` resolves to oneDNN (AMD
CPUs with AVX-512 under ``auto``) nothing is packed; ``--cpu-matmul torch`` measures packing there.
Run nothing else CPU-heavy beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from scratch import scratch_dir  # a temporary directory, removed at exit

from roll_core.strategies import cpu_matmul

SHAPES = [("attention projection", 768, 768), ("MLP up", 768, 3072), ("MLP down", 3072, 768)]  # label, in, out
KERNELS = ("mkl", "onednn")  # cpu_matmul.packing_kernel()'s choices
ROWS = (8, 32, 64, 128)


def median_seconds(fn, reps: int, rounds: int) -> float:
    fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - start) / reps)
    return statistics.median(samples)


def use_kernel(kernel: str) -> None:
    """Pack for ``kernel`` from now on, whichever this CPU would take (each shape checked again)."""
    cpu_matmul._packing_kernel = kernel
    cpu_matmul._packed_sizes.clear()


def kernels() -> list[str]:
    """The packing kernels this torch build offers here, each checked against F.linear."""
    offered = []
    for kernel in KERNELS:
        use_kernel(kernel)
        if all(cpu_matmul.packing_agrees(fan_out, fan_in) for _, fan_in, fan_out in SHAPES):
            offered.append(kernel)
    if not offered:
        raise SystemExit("this torch build offers no packed product (MKL's or oneDNN's) that agrees with F.linear")
    return offered


def products(rounds: int, offered: list[str]) -> None:
    print(f"{'shape':<22} {'rows x in -> out':>18} {'F.linear ms':>12}"
          + "".join(f" {kernel + ' ms':>10} {'speed-up':>9}" for kernel in offered))
    for label, fan_in, fan_out in SHAPES:
        weight = torch.randn(fan_out, fan_in)
        packed, pack_ms = {}, {}
        for kernel in offered:
            use_kernel(kernel)
            pack_ms[kernel] = 1e3 * median_seconds(lambda: cpu_matmul._pack(weight), 5, rounds)
            packed[kernel] = cpu_matmul._pack(weight)
        for rows in ROWS:
            x = torch.randn(rows, fan_in)
            plain = median_seconds(lambda: F.linear(x, weight), 20, rounds)
            line = f"{label:<22} {f'{rows} x {fan_in} -> {fan_out}':>18} {1e3 * plain:>12.3f}"
            for kernel in offered:
                use_kernel(kernel)
                fast = median_seconds(lambda: cpu_matmul._packed_linear(x, packed[kernel], weight, None, rows), 20,
                                      rounds)
                line += f" {1e3 * fast:>10.3f} {plain / fast:>8.2f}x"
            print(line)
        print(f"{label:<22} {'packing the weight':>18} "
              + ", ".join(f"{kernel} {pack_ms[kernel]:.3f} ms" for kernel in offered) + ", once per generate call")


def generate_calls(rounds: int, mode: str, offered: list[str]) -> None:
    from bench_packing import rl_batch
    from bench_precision import hf_roles
    from large_model import build_large_model

    from roll_core.data import Batch
    from roll_core.pipelines.runtime import load_tokenizer
    from roll_core.runtime.host_memory import keep_freed_memory

    keep_freed_memory()  # as roll's CPU workers do (runtime.reuse_freed_memory)
    cpu_matmul.configure(mode)  # before the engine is built: it adopts the kernel then
    path = str(build_large_model(Path(scratch_dir())))
    batch = rl_batch(load_tokenizer(path), 8, 64, 48.0, 0)
    prompts = {key: batch[key] for key in ("prompt_ids", "prompt_mask")}  # generate() fills in the rest
    _, engines, _, _ = hf_roles(path, 64, precisions=("fp32",), trained=())
    engine = engines["fp32"]

    def generate(kernel: str | None):
        cpu_matmul.configure(mode, pack_decoding_weights=kernel is not None)
        if kernel:
            use_kernel(kernel)
        engine.generator.manual_seed(0)
        with cpu_matmul.packed_for_decoding(engine.model) as layers:  # only to count them: generate packs its own
            pass
        start = time.perf_counter()
        out = engine.generate(Batch(dict(prompts)), max_new_tokens=64, temperature=1.0, top_p=1.0)
        return time.perf_counter() - start, out, layers

    variants: list[str | None] = [None, *offered]
    times: dict[str | None, list[float]] = {variant: [] for variant in variants}
    outs, layers = {}, 0
    for _ in range(rounds + 1):
        for variant in variants:
            seconds, outs[variant], count = generate(variant)
            times[variant].append(seconds)
            layers = max(layers, count)
    plain = statistics.median(times[None][1:])
    tokens = int(outs[None]["response_mask"].sum())
    print(f"generate, 95M, 64 rows, up to 64 new tokens ({tokens} generated), cpu_matmul {mode}, {layers} layers packed")
    print(f"  plain F.linear {plain:.3f} s")
    for kernel in offered:
        packed = statistics.median(times[kernel][1:])
        same = torch.equal(outs[None]["responses"], outs[kernel]["responses"])
        drift = float((outs[None]["infer_log_probs"] - outs[kernel]["infer_log_probs"]).abs().max())
        print(f"  packed for {kernel} {packed:.3f} s: {plain / packed:.2f}x faster; same tokens: {same}; "
              f"largest log-prob difference {drift:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-matmul", choices=["auto", "torch"], default="auto",
                        help="runtime.cpu_matmul for the generate calls (auto: as roll's workers resolve it here)")
    parser.add_argument("--part", choices=["products", "generate", "both"], default="both")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, CPU, {args.threads} threads, medians of {args.rounds} rounds; "
          f"roll packs for {cpu_matmul.packing_kernel()} on this CPU ({cpu_matmul.cpu_vendor() or 'vendor unknown'})")
    offered = kernels()
    if args.part in ("products", "both"):
        products(args.rounds, offered)
    if args.part in ("generate", "both"):
        generate_calls(args.rounds, args.cpu_matmul, offered)


if __name__ == "__main__":
    main()
