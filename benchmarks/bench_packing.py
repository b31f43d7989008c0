"""RL updates on packed rows against the padded layout, side by side (``roles.<role>.pack_sequences``).

Why it matters: an RL batch is groups of samples that share a prompt, and responses end at
different lengths. The padded layout computes every sample at the batch's widest prompt plus its
longest response, and each group's prompt once per sample. Packed rows
(:mod:`roll_core.strategies.packing`) compute each group's prompt once and no padding;
``max_tokens_per_micro_batch`` then sizes the forward-backward passes by tokens instead of samples.
``tests/test_packing.py`` shows the modes compute the same outputs, gradients and update.

Each mode runs the core's updater (GRPO's clipped loss, one optimizer step) on the same batch with a
fresh ``hf`` trainer: the embedded task's prompts, 8 samples each, response lengths drawn per
sample. Two sizes: the quickstart's tiny model (responses of 1-8 tokens, mean about 4, as the
quickstart's are after warm-up) and the embedded architecture at about 95M parameters (random
weights; 1-64 tokens, mean about 48, as that model's sampled responses are). The modes alternate,
so drift in the machine's speed falls on all; the first update of each is not counted.

    python benchmarks/bench_packing.py [--size tiny|large|both] [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from scratch import scratch_dir  # a temporary directory, removed at exit

SIZES = {  # a large model or not, prompts per step, longest response, mean response length
    "tiny": (False, 32, 8, 4.0),
    "large": (True, 8, 64, 48.0),
}
MODES = {  # role settings of each mode
    "padded, 64 samples per pass": dict(pack_sequences=False, micro_batch_size=64),
    "packed, 64 samples per pass": dict(pack_sequences=True, micro_batch_size=64),
    "packed, 16384 tokens per pass": dict(pack_sequences=True, micro_batch_size=64, max_tokens_per_micro_batch=16384),
}


def rl_batch(tokenizer, prompts: int, longest: int, mean: float, seed: int):
    """``prompts`` x 8 samples of the embedded task's prompts with random responses whose lengths
    are binomial on ``1..longest`` with the given mean, plus the fields GRPO's loss reads."""
    from roll_core.data import Batch
    from roll_core.embedded.tasks import CarryAdditionTask
    from roll_core.rollout.sync import tokenize_prompts

    rng = random.Random(seed)
    rows = rng.sample(CarryAdditionTask().train_rows(), prompts)
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [r["prompt"] for r in rows for _ in range(8)])
    p = (mean - 1) / (longest - 1)
    lengths = [1 + sum(rng.random() < p for _ in range(longest - 1)) for _ in range(len(prompt_ids))]
    width = max(lengths)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    g = torch.Generator().manual_seed(seed)
    responses = torch.randint(3, len(tokenizer), (len(lengths), width), generator=g) * mask
    return Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "responses": responses,
                  "response_mask": mask, "advantages": torch.randn(len(lengths), 1, generator=g) * mask,
                  "infer_log_probs": -torch.rand(len(lengths), width, generator=g) * mask})


def tokens_computed(batch, settings: dict) -> int:
    """Positions the forward passes of one update compute, padding included."""
    from roll_core.strategies.packing import pack_sequences
    from roll_core.training import micro_batches

    total = 0
    for micro in micro_batches(batch, settings["micro_batch_size"], settings.get("max_tokens_per_micro_batch")):
        if settings["pack_sequences"]:
            total += pack_sequences(micro["prompt_ids"], micro["prompt_mask"], micro["responses"],
                                    micro["response_mask"], max_length=1024, pad_token_id=0).tokens
        else:
            total += micro["prompt_ids"].numel() + micro["responses"].numel()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=[*SIZES, "both"], default="both")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from roll_core.algorithms.objective import ActorObjective
    from large_model import build_large_model
    from roll_core.config.schema import AlgorithmConfig, TrainRoleConfig
    from roll_core.embedded.model import build_tiny_model
    from roll_core.pipelines.runtime import load_tokenizer
    from roll_core.strategies.hf import HFTrainStrategy
    from roll_core.training import UpdateSpec, update

    objective = ActorObjective.from_config(AlgorithmConfig())
    print(f"{'size':>6} {'mode':<32} {'positions':>9} {'of padded':>9} {'s/update':>9} {'speed-up':>8}")
    for size in SIZES if args.size == "both" else [args.size]:
        large, prompts, longest, mean = SIZES[size]
        tmp = Path(scratch_dir())
        path = str(build_large_model(tmp) if large else build_tiny_model(tmp / size))
        batch = rl_batch(load_tokenizer(path), prompts, longest, mean, args.seed)
        padded = tokens_computed(batch, MODES[next(iter(MODES))])
        trainers = {mode: HFTrainStrategy(path, TrainRoleConfig(**settings), seed=0) for mode, settings in MODES.items()}
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds + 1):
            for mode, trainer in trainers.items():
                spec = UpdateSpec(max_grad_norm=1.0, micro_batch_size=MODES[mode]["micro_batch_size"])
                start = time.perf_counter()
                update(trainer, batch, objective, spec)
                times[mode].append(time.perf_counter() - start)
        base = statistics.median(times[next(iter(MODES))][1:])
        for mode, settings in MODES.items():
            seconds = statistics.median(times[mode][1:])
            positions = tokens_computed(batch, settings)
            print(f"{size:>6} {mode:<32} {positions:>9} {positions / padded:>9.0%} {seconds:>9.3f} {base / seconds:>7.2f}x")


if __name__ == "__main__":
    main()
