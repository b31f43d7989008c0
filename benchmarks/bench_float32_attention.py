"""bf16 on the CPU: autocast's attention against float32 attention where it is faster, side by side.

Why it matters: under bf16 autocast ``scaled_dot_product_attention`` runs torch's bfloat16 CPU
kernels. A decoding step casts the whole KV cache to bfloat16 at every step and runs the slower
kernel for one query; a pass that records gradients runs the slower backward kernel.
:mod:`roll_core.strategies.float32_attention` attends in float32 in both (decoding over a float32
cache). This script runs three contenders on the same work, fresh each and alternating, the first
round not counted:

* ``fp32``: the default precision, for reference;
* ``bf16 autocast``: ``precision: bf16`` with float32 attention switched off (autocast's attention
  everywhere, how bf16 ran before);
* ``bf16``: ``precision: bf16`` as roll runs it.

Each contender is an ``hf`` inference strategy that generates for the prompts and an ``hf`` trainer
that runs the core's updater (GRPO's clipped loss, one optimizer step, one pass over the samples).
It prints generated tokens per second, seconds per update, and how far each precision is from
fp32: the sampler's log-probs from an fp32 forward pass over what it sampled (mean absolute
difference over response tokens), and the update's gradient norm (relative difference).

Shapes (random weights): ``tiny``, the quickstart's model, 32 prompts x 8 samples, 8 new tokens,
responses of 1-8 tokens (mean 4) to train on; ``large``, the 95M model of ``large_model.py``, 8
prompts x 8 samples, 64 new tokens, responses of 1-64 (mean 48), as ``vs_trl.py``'s large step.

    python benchmarks/bench_float32_attention.py [--shape tiny|large|all] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from pathlib import Path

import torch
from bench_precision import SHAPES  # the same two steps: model, prompts, new tokens, mean response
from scratch import scratch_dir  # a temporary directory, removed at exit

CONTENDERS = ("fp32", "bf16 autocast", "bf16")


@contextlib.contextmanager
def autocasts_attention(contender: str):
    """For ``bf16 autocast``: no device attends in float32 while it is built and runs."""
    from roll_core.strategies import float32_attention

    kept = float32_attention.DEVICE_TYPES
    if contender == "bf16 autocast":
        float32_attention.DEVICE_TYPES = ()
    try:
        yield
    finally:
        float32_attention.DEVICE_TYPES = kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from bench_packed_attention import build, device_label, timed
    from bench_packing import rl_batch
    from roll_core.algorithms.objective import ActorObjective
    from roll_core.config.schema import AlgorithmConfig, InferRoleConfig, TrainRoleConfig
    from roll_core.data import Batch
    from roll_core.pipelines.runtime import load_tokenizer
    from roll_core.runtime.host_memory import keep_freed_memory
    from roll_core.strategies import cudnn_attention
    from roll_core.strategies.hf import HFInferStrategy, HFTrainStrategy
    from roll_core.training import UpdateSpec, update

    keep_freed_memory()  # as roll's CPU workers do (runtime.reuse_freed_memory)
    cudnn_attention.configure(False)  # as roll's workers do on a GPU (runtime.cudnn_attention)
    objective = ActorObjective.from_config(AlgorithmConfig())
    print(f"torch {torch.__version__}, {device_label()}, medians of {args.rounds} alternating rounds after one warm-up")
    print(f"{'shape':>6} {'contender':>14} {'tok/s':>8} {'s/update':>9} {'|dlogp| gen':>12} {'d grad norm':>12}")
    for name in SHAPES if args.shape == "all" else [args.shape]:
        kind, prompts, new_tokens, mean = SHAPES[name]
        path = build(kind, Path(scratch_dir()))
        batch = rl_batch(load_tokenizer(path), prompts, new_tokens, mean, 0)
        prompts_only = {key: batch[key] for key in ("prompt_ids", "prompt_mask")}
        spec = UpdateSpec(max_grad_norm=1.0, micro_batch_size=len(batch))
        engines, trainers = {}, {}
        for c in CONTENDERS:
            options = {"precision": c.split()[0]}
            with autocasts_attention(c):
                engines[c] = HFInferStrategy(path, InferRoleConfig(strategy_options=options), seed=0)
                trainers[c] = HFTrainStrategy(path, TrainRoleConfig(micro_batch_size=len(batch), lr=1e-12,
                                                                    strategy_options=options), seed=0)
        reference = HFTrainStrategy(path, TrainRoleConfig(), seed=0)
        rates: dict[str, list[float]] = {c: [] for c in CONTENDERS}
        updates: dict[str, list[float]] = {c: [] for c in CONTENDERS}
        gaps: dict[str, list[float]] = {c: [] for c in CONTENDERS}
        norms: dict[str, list[float]] = {c: [] for c in CONTENDERS}
        for _ in range(args.rounds + 1):
            for c in CONTENDERS:
                with autocasts_attention(c):
                    seconds, out = timed(lambda: engines[c].generate(Batch(dict(prompts_only)),
                                                                     max_new_tokens=new_tokens, temperature=1.0,
                                                                     top_p=1.0))
                    # lr 1e-12 rounds away: every round updates the same weights, so the norms compare like with like
                    update_seconds, metrics = timed(lambda: update(trainers[c], batch, objective, spec))
                mask = out["response_mask"].bool()
                rates[c].append(float(mask.sum()) / seconds)
                updates[c].append(update_seconds)
                exact = reference.compute_log_probs(out, 1.0)
                gaps[c].append(float((out["infer_log_probs"] - exact)[mask].abs().mean()))
                norms[c].append(metrics["train/grad_norm"])
        fp32_norm = statistics.mean(norms["fp32"])
        for c in CONTENDERS:
            print(f"{name:>6} {c:>14} {statistics.median(rates[c][1:]):>8.0f} {statistics.median(updates[c][1:]):>9.3f} "
                  f"{statistics.mean(gaps[c]):>12.5f} {abs(statistics.mean(norms[c]) / fp32_norm - 1):>12.2e}")
        ratio = {what: statistics.median(d["bf16"][1:]) / statistics.median(d["bf16 autocast"][1:])
                 for what, d in (("generation", rates), ("update", updates))}
        print(f"{name:>6} bf16 / bf16 autocast: generation {ratio['generation']:.2f}x tokens/s, "
              f"update {1 / ratio['update']:.2f}x faster", flush=True)


if __name__ == "__main__":
    main()
