"""bf16 generation on the CPU: autocast's attention against float32 decoding attention, side by side.

Why it matters: under bf16 autocast a decoding step's ``scaled_dot_product_attention`` casts the
whole KV cache to bfloat16 at every step and runs torch's slower bfloat16 kernel for one query;
:mod:`roll_core.strategies.decode_attention` keeps the cache in float32 and attends in float32
instead. This script generates for the same prompts with three ``hf`` inference strategies, fresh
each and alternating, the first round not counted:

* ``fp32``: the default precision, for reference;
* ``bf16 autocast``: ``precision: bf16`` with the model on plain ``sdpa`` (how it ran before);
* ``bf16``: ``precision: bf16`` as roll runs it (float32 decoding attention).

It prints generated tokens per second and, for each precision, how far the sampler's log-probs are
from an fp32 forward pass over what it sampled (mean absolute difference over response tokens).
Shapes (random weights): ``tiny``, the quickstart's model, 32 prompts x 8 samples, 8 new tokens;
``large``, the 95M model of ``large_model.py``, 8 prompts x 8 samples, 64 new tokens.

    python benchmarks/bench_decode_attention.py [--shape tiny|large|all] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

SHAPES = {"tiny": ("tiny", 32, 8), "large": ("large", 8, 64)}  # model, prompts, new tokens
CONTENDERS = ("fp32", "bf16 autocast", "bf16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from bench_packed_attention import build, device_label, timed
    from bench_packing import rl_batch
    from roll_core.config.schema import InferRoleConfig, TrainRoleConfig
    from roll_core.data import Batch
    from roll_core.pipelines.runtime import load_tokenizer
    from roll_core.runtime.host_memory import keep_freed_memory
    from roll_core.strategies.hf import HFInferStrategy, HFTrainStrategy

    keep_freed_memory()  # as roll's CPU workers do (runtime.reuse_freed_memory)
    print(f"torch {torch.__version__}, {device_label()}, medians of {args.rounds} alternating rounds after one warm-up")
    print(f"{'shape':>6} " + " ".join(f"{name + ' tok/s':>18}" for name in CONTENDERS)
          + f" {'bf16 / autocast':>16} " + " ".join(f"{name + ' |dlogp|':>20}" for name in CONTENDERS))
    for name in SHAPES if args.shape == "all" else [args.shape]:
        kind, prompts, new_tokens = SHAPES[name]
        path = build(kind, Path(tempfile.mkdtemp()))
        batch = rl_batch(load_tokenizer(path), prompts, new_tokens, new_tokens / 2, 0)
        prompts_only = {key: batch[key] for key in ("prompt_ids", "prompt_mask")}
        engines = {c: HFInferStrategy(path, InferRoleConfig(strategy_options={"precision": c.split()[0]}), seed=0)
                   for c in CONTENDERS}
        engines["bf16 autocast"].model.config._attn_implementation = "sdpa"  # decoding attention not adopted
        reference = HFTrainStrategy(path, TrainRoleConfig(), seed=0)
        rates: dict[str, list[float]] = {c: [] for c in CONTENDERS}
        gaps: dict[str, list[float]] = {c: [] for c in CONTENDERS}
        for _ in range(args.rounds + 1):
            for c in CONTENDERS:
                seconds, out = timed(lambda: engines[c].generate(Batch(dict(prompts_only)), max_new_tokens=new_tokens,
                                                                 temperature=1.0, top_p=1.0))
                mask = out["response_mask"].bool()
                rates[c].append(float(mask.sum()) / seconds)
                exact = reference.compute_log_probs(out, 1.0)
                gaps[c].append(float((out["infer_log_probs"] - exact)[mask].abs().mean()))
        rate = {c: statistics.median(rates[c][1:]) for c in CONTENDERS}
        gap = {c: statistics.mean(gaps[c]) for c in CONTENDERS}
        print(f"{name:>6} " + " ".join(f"{rate[c]:>18.0f}" for c in CONTENDERS)
              + f" {rate['bf16'] / rate['bf16 autocast']:>15.2f}x " + " ".join(f"{gap[c]:>20.5f}" for c in CONTENDERS),
              flush=True)


if __name__ == "__main__":
    main()
