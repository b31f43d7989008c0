"""Supervised steps with and without sequence packing (``warmup.packing``), side by side.

Why it matters: SFT data has long-tailed lengths, and a padded batch computes every row at the
longest row's length. Packing puts several examples in one row (position ids restart per example,
so each attends to itself only) and computes no padding. Both modes train the same model on the
same rows with the core's updater (``tests/test_packing.py`` shows they compute the same update);
this measures the seconds per step and the share of computed positions that are padding.

The rows: the embedded task's prompts, each with a demonstration of a random length (lognormal,
median 24 characters, capped at 400), as SFT answers come. The model is the embedded architecture
at hidden 256, 4 layers (random weights, built here). The modes alternate step by step, so drift in
the machine's speed falls on both; the first step of each is not counted.

    python benchmarks/bench_sft_packing.py [--steps 8] [--batch 64] [--max-length 512]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from scratch import scratch_dir  # a temporary directory, removed at exit


def rows_with_long_tail(n: int, seed: int) -> list[dict]:
    from roll_core.embedded.tasks import CarryAdditionTask

    rng = random.Random(seed)
    alphabet = "0123456789+-*= abcdefghijklmnopqrstuvwxyz"
    prompts = [r["prompt"] for r in CarryAdditionTask().train_rows()]
    return [{"prompt": rng.choice(prompts),
             "demonstration": "".join(rng.choice(alphabet) for _ in range(min(400, int(rng.lognormvariate(3.2, 0.9)))))}
            for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from roll_core.algorithms.objective import SupervisedObjective
    from roll_core.config import load_config
    from roll_core.embedded.model import TinyModelConfig, build_tiny_model
    from roll_core.pipelines.runtime import load_tokenizer
    from roll_core.pipelines.batches import demonstration_batch, packed_demonstration_batch
    from roll_core.strategies.hf import HFTrainStrategy
    from roll_core.training import UpdateSpec, update

    path = str(build_tiny_model(Path(scratch_dir()) / "model", TinyModelConfig(hidden_size=256, num_layers=4,
                                                                                    num_heads=4, intermediate_size=1024)))
    tokenizer = load_tokenizer(path)
    # the padded baseline: without the role-level packing that would otherwise remove its padding too
    cfg = load_config(None, [f"roles.actor_train.micro_batch_size={args.batch}", "roles.actor_train.pack_sequences=false"])
    spec = UpdateSpec(max_grad_norm=1.0, micro_batch_size=args.batch, optimizer="warmup", lr=1e-3,
                      metric_prefix="warmup")
    loss_fn = SupervisedObjective("warmup/loss")
    trainers = {mode: HFTrainStrategy(path, cfg.roles.actor_train, seed=0) for mode in ("padded", "packed")}
    seconds: dict[str, list[float]] = {mode: [] for mode in trainers}
    positions: dict[str, list[tuple[int, int]]] = {mode: [] for mode in trainers}
    for step in range(args.steps + 1):
        rows = rows_with_long_tail(args.batch, seed=step)
        padded = demonstration_batch(tokenizer, rows)
        real = int(padded["prompt_mask"].sum() + padded["response_mask"].sum())  # the examples' own tokens
        batches = {"padded": padded, "packed": packed_demonstration_batch(tokenizer, rows, args.max_length)}
        for mode, trainer in trainers.items():
            batch = batches[mode]
            start = time.perf_counter()
            update(trainer, batch, loss_fn, spec)
            if step:  # the first step allocates and warms up
                seconds[mode].append(time.perf_counter() - start)
                computed = len(batch) * (batch["prompt_ids"].shape[1] + batch["responses"].shape[1])
                positions[mode].append((computed, real))
    print(f"{args.batch} examples per step, {args.steps} timed steps each, modes alternating; hidden 256, 4 layers")
    print(f"{'mode':8} {'positions/step':>15} {'padding':>8} {'s/step':>8}")
    for mode in trainers:
        computed = sum(c for c, _ in positions[mode])
        real = sum(r for _, r in positions[mode])
        print(f"{mode:8} {computed // args.steps:>15} {1 - real / computed:>8.1%} {statistics.median(seconds[mode]):>8.3f}")
    ratio = statistics.median(seconds["padded"]) / statistics.median(seconds["packed"])
    print(f"packed is {ratio:.2f}x the speed of padded (median seconds per step)")


if __name__ == "__main__":
    main()
