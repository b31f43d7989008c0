"""AdamW's step: torch's default loop over the tensors against its fused kernel, side by side.

Why it matters: roll's torch strategies step AdamW over every trained parameter once per optimizer
step. On the CPU torch's default runs a dozen elementwise ops per tensor (moments, bias
corrections, the square root, the update), each a pass over memory; ``fused=True`` makes one pass.
``roll_core.strategies.hf.fused_adamw`` picks the fused kernel wherever it takes the parameters.

Two AdamW optimizers over two copies of one model's parameters, the same gradients, alternating;
the first round is not counted. It prints the median seconds per step of each and how far the two
copies' weights are apart after all the rounds (the same update up to float rounding).

Shapes (random weights): ``tiny``, the quickstart's model (0.5M parameters); ``large``, the 95M model
of ``large_model.py``.

    python benchmarks/bench_fused_adamw.py [--shape tiny|large|all] [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from scratch import scratch_dir  # a temporary directory, removed at exit

CONTENDERS = {"loop (torch's default)": None, "fused": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["tiny", "large", "all"], default="all")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from bench_packed_attention import build, device_label, timed
    from roll_core.runtime.host_memory import keep_freed_memory
    from roll_core.strategies.models import load_causal_lm

    keep_freed_memory()  # as roll's CPU workers do (runtime.reuse_freed_memory)
    print(f"torch {torch.__version__}, {device_label()}, medians of {args.rounds} alternating rounds after one warm-up")
    print(f"{'shape':>6} {'parameters':>11} " + " ".join(f"{name + ' s':>24}" for name in CONTENDERS)
          + f" {'speed-up':>9} {'max |dw|':>9}")
    for shape in ("tiny", "large") if args.shape == "all" else (args.shape,):
        path = build(shape, Path(scratch_dir()))
        models = {name: load_causal_lm(str(path), torch.device("cpu")) for name in CONTENDERS}
        optimizers = {name: torch.optim.AdamW(models[name].parameters(), lr=3e-4, fused=fused)
                      for name, fused in CONTENDERS.items()}
        g = torch.Generator().manual_seed(0)
        grads = [torch.randn(p.shape, generator=g) * 1e-3 for p in next(iter(models.values())).parameters()]
        seconds: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        for _ in range(args.rounds + 1):
            for name in CONTENDERS:
                for p, grad in zip(models[name].parameters(), grads):
                    p.grad = grad.clone()
                seconds[name].append(timed(optimizers[name].step)[0])
        loop, fused = (list(m.parameters()) for m in models.values())
        gap = max(float((a - b).detach().abs().max()) for a, b in zip(loop, fused))
        medians = [statistics.median(seconds[name][1:]) for name in CONTENDERS]
        count = sum(p.numel() for p in loop)
        print(f"{shape:>6} {count / 1e6:>10.1f}M " + " ".join(f"{m:>24.4f}" for m in medians)
              + f" {medians[0] / medians[1]:>8.2f}x {gap:>9.1e}", flush=True)


if __name__ == "__main__":
    main()
