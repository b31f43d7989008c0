"""What a top-p/top-k cut costs a vLLM rollout: the re-scoring pass, at temperature 1 and at another.

Why it matters: vLLM reports the sampled tokens' log-probs after its top-k/top-p cuts, roll's are
before them (as the trainer computes them), so with ``rollout.top_p < 1`` or ``rollout.top_k`` the
``vllm`` strategy re-scores its samples with ``compute_log_probs`` (one prefill pass). vLLM scores
a prompt at temperature 1; at another, the strategy divides the engine's logits by T while the pass
runs alone in the engine. Its fallback, for a model whose logits cannot be scaled, asks for the
whole vocabulary's log-probs at every position: at a real vocabulary that is most of the cost.

One engine, one batch, four settings side by side, each timed as a whole ``generate`` call (the
median of ``--repeats`` calls after a warm-up call each):

* ``T 0.7, no cut``: the baseline, no re-scoring;
* ``T 1, top-p 0.95``: a cut at T = 1, re-scored with one log-prob per position;
* ``T 0.7, top-p 0.95``: a cut at another T, re-scored on the scaled logits;
* ``... whole vocab``: the same with the scaling turned off (the fallback).

The model is the embedded architecture (hidden 256, 2 layers, random weights) with the vocabulary
widened to ``--vocab`` (151,936 by default, Qwen2.5's), since the fallback's cost grows with it.

    python benchmarks/bench_rescore.py [--rows 8] [--new-tokens 16] [--vocab 151936] [--repeats 3]

Needs roll-vllm and vLLM (``pip install "roll-vllm[cpu]"``).
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

from roll_core.embedded.model import TinyModelConfig, build_tiny_model
from roll_core.testing import left_padded_prompts
from scratch import scratch_dir  # a temporary directory, removed at exit

SHAPE = TinyModelConfig(hidden_size=256, num_layers=2, num_heads=4, intermediate_size=512, max_position_embeddings=128)
SETTINGS = {  # name: (temperature, top_p, scale the logits)
    "T 0.7, no cut": (0.7, 1.0, True),
    "T 1, top-p 0.95": (1.0, 0.95, True),
    "T 0.7, top-p 0.95": (0.7, 0.95, True),
    "T 0.7, top-p 0.95, whole vocab": (0.7, 0.95, False),
}


def wide_vocabulary_model(vocab: int):
    """The embedded architecture at :data:`SHAPE` with ``vocab`` rows of embeddings (tied)."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(scratch_dir() + "/model", SHAPE)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(vocab)
    model.save_pretrained(path)
    return path


def seconds(engine, batch, new_tokens: int, temperature: float, top_p: float) -> float:
    start = time.perf_counter()
    engine.generate(batch, max_new_tokens=new_tokens, temperature=temperature, top_p=top_p)
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from roll_vllm.strategy import VLLMInferStrategy

    torch.set_num_threads(2)
    engine = VLLMInferStrategy(str(wide_vocabulary_model(args.vocab)),
                               types.SimpleNamespace(strategy_options={"max_model_len": 128}), seed=0)
    scales = engine.scales_logits
    batch = left_padded_prompts(rows=args.rows, width=8)
    print(f"{args.rows} prompts of 6-8 tokens, {args.new_tokens} new tokens each, vocabulary {args.vocab:,}; "
          f"median of {args.repeats} generate calls after one warm-up call")
    print(f"{'setting':>31} {'s / call':>9} {'x the baseline':>15}")
    baseline = None
    for name, (temperature, top_p, scale) in SETTINGS.items():
        engine.scales_logits = scales and scale
        times = [seconds(engine, batch, args.new_tokens, temperature, top_p) for _ in range(args.repeats + 1)][1:]
        median = statistics.median(times)
        baseline = baseline or median
        print(f"{name:>31} {median:>9.3f} {median / baseline:>14.1f}x", flush=True)
    engine.loop.close()


if __name__ == "__main__":
    main()
