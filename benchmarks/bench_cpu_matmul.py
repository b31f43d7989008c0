"""torch's default fp32 GEMM against oneDNN's on this CPU, on the shapes roll's models compute.

``runtime.cpu_matmul`` (:mod:`roll_core.strategies.cpu_matmul`) can route the linear layers of models
on CPU through oneDNN; ``auto`` does so on AMD CPUs with AVX-512, where MKL's sgemm ran at a third
to a half of oneDNN's speed, and not on Intel's, where MKL was level or faster, nor on AMD's with
AVX2 only, where oneDNN's 95M update was 1.7-2x slower. This script shows whether it pays
on the machine it runs on: for each shape it times an ``nn.Linear`` forward, and forward plus
backward, with torch's own kernel (``F.linear``: MKL in the official wheels) and with roll's
:class:`~roll_core.strategies.cpu_matmul.OneDNNLinear`, alternating the two for ``--rounds`` rounds,
and prints GFLOP/s and the ratio. It also checks that both give the same numbers (fp32 either way;
only the order of the sums differs).

Shapes (rows x in -> out):

- the 95M model of ``benchmarks/large_model.py`` (hidden 768, MLP 3072): a packed training pass of
  3,240 positions, and a decoding step of 64 rows;
- the quickstart's tiny model (hidden 128, MLP 512): a training pass of 1,536 positions and a decoding
  step of 256 rows.

    python benchmarks/bench_cpu_matmul.py [--threads 2] [--rounds 5]

Run nothing else CPU-heavy beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from roll_core.strategies import cpu_matmul

SHAPES = [  # (label, rows, in, out)
    ("large: training, attention projection", 3240, 768, 768),
    ("large: training, MLP up", 3240, 768, 3072),
    ("large: training, MLP down", 3240, 3072, 768),
    ("large: decoding step, MLP up", 64, 768, 3072),
    ("tiny: training, MLP up", 1536, 128, 512),
    ("tiny: decoding step, MLP up", 256, 128, 512),
]


def seconds(fn, reps: int) -> float:
    fn()  # warm-up: oneDNN builds its primitive for a shape on first use
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_matmul.onednn_available():
        raise SystemExit("this torch build offers no oneDNN linear kernel: nothing to compare")
    cpu_matmul.configure("onednn")
    print(f"torch {torch.__version__}, {args.threads} threads, medians of {args.rounds} alternating rounds; GFLOP/s")
    avx512 = "with" if "avx512f" in cpu_matmul.cpu_flags() else "without"
    print(f"CPU vendor {cpu_matmul.cpu_vendor() or 'unknown'}, {avx512} AVX-512: runtime.cpu_matmul auto takes "
          f"{'oneDNN' if cpu_matmul.onednn_preferred() else 'torch'} here")
    print(f"{'shape':40s} {'rows x in -> out':>20s} {'pass':>9s} {'torch':>8s} {'oneDNN':>8s} {'ratio':>7s}")
    for label, rows, d_in, d_out in SHAPES:
        gen = torch.Generator().manual_seed(0)
        plain = torch.nn.Linear(d_in, d_out)
        fast = torch.nn.Linear(d_in, d_out)
        fast.load_state_dict(plain.state_dict())
        cpu_matmul.adopt(fast)
        x = torch.randn(rows, d_in, generator=gen)
        with torch.no_grad():
            torch.testing.assert_close(fast(x), plain(x), rtol=1e-4, atol=1e-4)
        flops = 2 * rows * d_in * d_out
        reps = max(3, int(2e10 / flops))
        for name, passes in (("forward", 1), ("fwd+bwd", 3)):
            def run(layer):
                if passes == 3:  # forward, then the input's and the weight's gradients
                    layer(x.requires_grad_()).sum().backward()
                else:
                    with torch.no_grad():
                        layer(x)
            times: dict[str, list[float]] = {"torch": [], "onednn": []}
            for _ in range(args.rounds):
                times["torch"].append(seconds(lambda: run(plain), reps))
                times["onednn"].append(seconds(lambda: run(fast), reps))
            rate = {k: passes * flops / statistics.median(v) / 1e9 for k, v in times.items()}
            print(f"{label:40s} {f'{rows} x {d_in} -> {d_out}':>20s} {name:>9s} {rate['torch']:8.0f} "
                  f"{rate['onednn']:8.0f} {rate['onednn'] / rate['torch']:6.2f}x")


if __name__ == "__main__":
    main()
