"""Sampling throughput: roll's KV-cached loop vs `transformers` `generate`, side by side, same model.

Why it matters: rollout dominates RL wall-clock. The hf strategy uses its own loop (private RNG,
returns sampled log-probs); this checks it is not slower than the library's `generate`, which
returns neither the log-probs by default nor draws from a per-worker generator.

    python benchmarks/bench_sampling.py [--batch 256] [--new-tokens 8] [--repeats 5]
"""

import argparse
import tempfile
import time

import torch

from roll_core.embedded.model import build_tiny_model
from roll_core.strategies.sequences import sample_responses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tempfile.mkdtemp() + "/tiny")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    enc = tok([f"{i % 100:02d}+{(i * 7) % 100:02d}=" for i in range(args.batch)], return_tensors="pt",
              add_special_tokens=False, padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    # EOS is suppressed in both so every row generates exactly new_tokens tokens (equal work).
    eos = -1

    def roll_loop():
        sample_responses(model, ids, mask, max_new_tokens=args.new_tokens, eos_token_id=eos,
                         pad_token_id=tok.pad_token_id, temperature=1.0, generator=torch.Generator().manual_seed(0))

    def hf_generate():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                           max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                           pad_token_id=tok.pad_token_id)

    results = {}
    for name, fn in (("roll sample_responses", roll_loop), ("transformers generate", hf_generate)):
        fn()  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        best = min(times)
        results[name] = args.batch * args.new_tokens / best
        print(f"{name:24s} {results[name]:10.0f} tokens/s (best of {args.repeats}: {best * 1000:.1f} ms)")
    ratio = results["roll sample_responses"] / results["transformers generate"]
    print(f"ratio roll / transformers: {ratio:.2f}x  (batch {args.batch}, {args.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
