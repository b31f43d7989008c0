"""bf16 on a GPU with cuDNN's attention on and off (``runtime.cudnn_attention``): generation and one
update of the 95M model, a new batch shape each round, against fp32 generation.

Why it matters: for bfloat16 inputs on recent NVIDIA GPUs ``scaled_dot_product_attention`` picks
cuDNN's kernel, which builds an execution plan for each new shape, and RL rarely repeats a shape
(every decoding step attends over one more key). roll turns the kernel off in every worker
(:mod:`roll_core.strategies.cudnn_attention`); this shows what that buys on the card at hand.

Each round makes a new RL batch (8 prompts x 8 samples, 64 new tokens by default) and times, on the
strategies roll's ``hf`` backend uses: fp32 generation, bf16 generation with cuDNN's attention on then
off, and one bf16 update with it on then off. Each reading is between two synchronisations. Round 0
is every shape's first sight; later rounds show what stays. On a CPU the switch changes nothing.

    python benchmarks/bench_cudnn_attention.py [--rounds 4] [--new-tokens 64] [--model large|tiny]

``--model tiny`` (the quickstart's model) only checks that the script runs: the tests use it, since a
95M bf16 update on a CPU without bf16 instructions takes minutes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench_packed_attention import build, device_label, timed
from bench_packing import rl_batch
from bench_precision import hf_roles
from scratch import scratch_dir
from roll_core.data import Batch
from roll_core.pipelines.runtime import load_tokenizer
from roll_core.strategies import cudnn_attention
from roll_core.training import update

GENERATIONS = (("fp32", False), ("bf16", True), ("bf16", False))  # (precision, cuDNN's attention)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model", choices=["large", "tiny"], default="large")
    args = ap.parse_args()
    path = build(args.model, Path(scratch_dir()))
    tokenizer = load_tokenizer(path)
    batches = [rl_batch(tokenizer, 8, 64, 48.0, seed) for seed in range(args.rounds)]  # a new shape each round
    rows = len(batches[0])
    trainers, engines, objective, spec = hf_roles(path, rows, trained=("bf16",))
    trainer = trainers["bf16"]
    print(f"{device_label()}, torch {torch.__version__}: {rows} rows, {args.new_tokens} new tokens, seconds")
    try:
        for round_, batch in enumerate(batches):
            prompts = Batch({k: batch[k] for k in ("prompt_ids", "prompt_mask")})
            readings = []
            for precision, cudnn in GENERATIONS:
                cudnn_attention.configure(cudnn)
                seconds, _ = timed(lambda: engines[precision].generate(
                    prompts, max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0))
                readings.append(f"generate {precision} cudnn={'on' if cudnn else 'off'} {seconds:.3f}")
            for cudnn in (True, False):
                cudnn_attention.configure(cudnn)
                seconds, _ = timed(lambda: update(trainer, batch, objective, spec))
                readings.append(f"update bf16 cudnn={'on' if cudnn else 'off'} {seconds:.3f}")
            print(f"round {round_}: " + "  ".join(readings), flush=True)
    finally:
        cudnn_attention.configure(False)  # roll's default


if __name__ == "__main__":
    main()
