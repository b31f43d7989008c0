"""Drawing one token per row: ``torch.multinomial`` against roll's inverse-transform draw, side by side.

Why it matters: the sampler draws a token for every row at every decoding step. For one sample
``torch.multinomial`` draws an exponential variate for every vocabulary entry of every row
(``argmax(p / q)``, ``q ~ Exp(1)``), one at a time on the CPU; ``roll_core.strategies.sequences.draw_tokens``
draws one uniform per row and finds its token in the row's cumulative weights. A real model's
vocabulary (151,936 entries for Qwen2.5) makes the difference large on the CPU.

For each vocabulary size, the same probabilities (a softmax of random logits at temperature 1, the
shape of one decoding step), the two alternating for ``--rounds`` rounds after one warm-up; it prints
the median milliseconds of each and their ratio, and the total-variation distance between the two
methods' token frequencies over all rounds against that of two multinomial runs (both small: they
draw from the same distribution).

    python benchmarks/bench_token_draw.py [--rows 64] [--vocab 98 32000 151936] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from roll_core.strategies.sequences import draw_tokens


def multinomial(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


CONTENDERS = {"torch.multinomial": multinomial, "roll draw_tokens": draw_tokens}


def frequencies(tokens: list[torch.Tensor], vocab: int) -> torch.Tensor:
    counts = torch.bincount(torch.cat(tokens), minlength=vocab).double()
    return counts / counts.sum()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, nargs="+", default=[98, 32000, 151936])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    print(f"{args.rows} rows, {torch.get_num_threads()} threads, median of {args.rounds} rounds")
    print(f"{'vocabulary':>10} " + " ".join(f"{name + ' ms':>22}" for name in CONTENDERS)
          + "   ratio   TV (draw vs multinomial, multinomial vs itself)")
    for vocab in args.vocab:
        probs = torch.randn(args.rows, vocab, generator=torch.Generator().manual_seed(vocab)).mul(2).softmax(-1)
        generators = {name: torch.Generator().manual_seed(i) for i, name in enumerate(CONTENDERS)}
        reference = torch.Generator().manual_seed(99)
        times = {name: [] for name in CONTENDERS}
        drawn = {name: [] for name in CONTENDERS}
        again = []
        for name, draw in CONTENDERS.items():
            draw(probs, generators[name])  # warm-up
        for _ in range(args.rounds):
            for name, draw in CONTENDERS.items():
                start = time.perf_counter()
                tokens = draw(probs, generators[name])
                times[name].append(time.perf_counter() - start)
                drawn[name].append(tokens)
            again.append(multinomial(probs, reference))
        medians = {name: statistics.median(ts) * 1000 for name, ts in times.items()}
        first, second = CONTENDERS
        base = frequencies(drawn[first], vocab)
        tv = 0.5 * (frequencies(drawn[second], vocab) - base).abs().sum()
        tv_self = 0.5 * (frequencies(again, vocab) - base).abs().sum()
        print(f"{vocab:>10} " + " ".join(f"{medians[n]:>22.3f}" for n in CONTENDERS)
              + f"   {medians[first] / medians[second]:5.1f}x   {tv:.3f}, {tv_self:.3f}")


if __name__ == "__main__":
    main()
