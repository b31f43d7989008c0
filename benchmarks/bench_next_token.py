"""One decoding step's sampling, logits to token and log-probability: roll's sampler before and after
it worked in the logits' own memory and found the top-p nucleus without a sort, side by side.

Why it matters: at a real model's vocabulary (151,936 entries for Qwen2.5) the sampler's own work
per decoding step was tens of milliseconds on the CPU, and hundreds with top-p. Before, the step
divided the logits by the temperature, took a ``softmax`` to draw from and a ``log_softmax`` for the
token's log-probability, each a new ``[B, V]`` tensor (at 64 x 151,936 float32, 39 MB: fresh pages
from the kernel each time), and with ``top_p < 1`` sorted every row. Now
``roll_core.strategies.sequences.next_tokens`` turns the logits into weights in place and
``nucleus_tokens`` draws from the nucleus by rejection. Both sides draw with ``draw_tokens``.

For each vocabulary, top-p and spread of the logits (``randn * spread``: 2 is nearly flat at a large
vocabulary, 6 puts most of the weight on a few hundred tokens), the two alternate for ``--rounds``
rounds on copies of the same logits, and it prints the median milliseconds of each, their ratio, the
nucleus' mean size, and two checks over every draw of the new step: its tokens all lie in the nucleus
as the old step's sort defines it, and its log-probabilities' largest difference from the old step's
``log_softmax`` at the same tokens. The new step runs twice, with each of its nucleus draws:
``nucleus_tokens`` (rejection, what it uses on the CPU) and ``sorted_nucleus_tokens`` (a sort of the
weights in place of the old step's sort of logits and softmax; what it uses on a GPU).

A third contender, ``previous``, is the new step as it was until commit ce339d8: its weights came
from torch's ``exp``, its totals from a pass of their own besides the draw's block sums, and the
rejection's check from masked sums by ``torch.where``. Now the weights come from ``exp2`` (a third
of ``exp``'s time on the CPU), the totals from the draw's block sums, and the check's sums have no
branches; the ``previous / ...`` columns are those changes.

``--keep-freed-memory`` makes the process keep the memory it frees, as roll's CPU workers do
(``runtime.reuse_freed_memory``, :mod:`roll_core.runtime.host_memory`): a new tensor then reuses the
heap instead of fresh pages, and the old step's extra tensors cost far less. Without it glibc's
allocator is as it comes, as in any process outside roll's workers.

``--device cuda`` runs both on a GPU (synchronising before each reading), where a new tensor comes
from torch's caching allocator and a sort is fast: whether the rejection still pays there is its question.

    python benchmarks/bench_next_token.py [--rows 64] [--vocab 32000 151936] [--top-p 1.0 0.9] [--spread 2 6]
                                          [--temperature 1.0] [--keep-freed-memory] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from unittest.mock import patch

import torch

import roll_core.strategies.sequences as sequences
from bench_packed_attention import timed
from roll_core.runtime.host_memory import keep_freed_memory
from roll_core.strategies.sequences import next_tokens, nucleus_tokens, sorted_nucleus_tokens


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The old step's nucleus: logits outside it masked to -inf, by sorting every row."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop_sorted = (probs.cumsum(-1) - probs) >= top_p  # the weight before a token reaches top_p
    return logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))


def step_before(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator, top_k: int = 0):
    """The sampler's decoding step before 2026-11-27: a new [B, V] tensor at each stage. It draws
    with the module's ``draw_tokens`` as it is at the call (``bench_sampling`` swaps in an older one).
    It had no top-k: ``top_k`` is taken as ``next_tokens`` takes it, and must be 0."""
    assert top_k == 0, "the step before had no top-k"
    scaled = logits / temperature
    token = sequences.draw_tokens(top_p_filter(scaled, top_p).softmax(-1), generator)
    return token, scaled.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)


def weight_above_by_where(weights: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """The nucleus check's masked sums as they were until commit ce339d8: by ``torch.where``."""
    total = torch.zeros_like(floor)
    for part in weights.split(sequences.NUCLEUS_CHUNK, -1):
        total += torch.where(part > floor, part, 0.0).sum(-1, keepdim=True)
    return total


def step_previous(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator):
    """``next_tokens`` as it was until commit ce339d8 (2026-11-27): the weights by ``exp``, the totals
    summed in a pass of their own besides the draw's block sums, and the rejection's masked sums by
    ``torch.where``."""
    logits.sub_(logits.amax(-1, keepdim=True))
    weights = (logits if temperature == 1.0 else logits.div_(temperature)).exp_()
    totals = weights.sum(-1, keepdim=True)
    if top_p >= 1.0:
        token = sequences.draw_tokens(weights, generator)
    else:
        with patch.object(sequences, "_weight_above", weight_above_by_where):
            token = sequences.nucleus_sampler(weights.device)(weights, totals, top_p, generator)
    return token, (weights.gather(-1, token[:, None]) / totals).log().squeeze(-1)


def step_with(nucleus):
    """``next_tokens`` drawing its nucleus with ``nucleus`` on every device (it picks one by device)."""
    def step(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator):
        with patch.object(sequences, "nucleus_sampler", lambda device: nucleus):
            return next_tokens(logits, temperature, top_p, generator)
    return step


CONTENDERS = {"before": step_before, "previous": step_previous, "rejection": step_with(nucleus_tokens),
              "sort": step_with(sorted_nucleus_tokens)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    ap.add_argument("--top-p", type=float, nargs="+", default=[1.0, 0.9])
    ap.add_argument("--spread", type=float, nargs="+", default=[2.0, 6.0])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--keep-freed-memory", action="store_true", help="as roll's CPU workers: no fresh pages")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU")
    args = ap.parse_args()
    device = torch.device(args.device)
    kept = args.keep_freed_memory and keep_freed_memory()
    where = (f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}" if device.type == "cuda"
             else f"{torch.get_num_threads()} threads, freed memory {'kept' if kept else 'returned (glibc default)'}")
    temperature = args.temperature
    print(f"{args.rows} rows, temperature {temperature}, median of {args.rounds} rounds, {where}")
    print(f"{'vocabulary':>10} {'top_p':>5} {'spread':>6} {'before ms':>10} {'previous ms':>11} {'rejection ms':>12} "
          f"{'sort ms':>8} {'before / rejection':>18} {'before / sort':>13} {'previous / rejection':>20} {'previous / sort':>15} "
          f"{'nucleus':>8}  all in nucleus  largest log-prob difference")
    for vocab, top_p, spread in itertools.product(args.vocab, args.top_p, args.spread):
        logits = (torch.randn(args.rows, vocab, generator=torch.Generator().manual_seed(vocab)) * spread).to(device)
        allowed = torch.isfinite(top_p_filter(logits / temperature, top_p))
        reference = (logits / temperature).log_softmax(-1)
        generators = {name: torch.Generator(device).manual_seed(i) for i, name in enumerate(CONTENDERS)}
        times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        inside, difference = True, 0.0
        for round_ in range(args.rounds + 1):  # the first is a warm-up
            for name, step in CONTENDERS.items():
                own = logits.clone()  # next_tokens overwrites its logits, as the sampler's own
                elapsed, (token, logp) = timed(lambda: step(own, temperature, top_p, generators[name]))
                if round_:
                    times[name].append(elapsed)
                if name not in ("before", "previous"):
                    inside &= bool(allowed.gather(-1, token[:, None]).all())
                    expected = reference.gather(-1, token[:, None]).squeeze(-1)
                    difference = max(difference, float((logp - expected).abs().max()))
        before, previous, rejection, sort = (statistics.median(times[name]) * 1000 for name in CONTENDERS)
        print(f"{vocab:>10} {top_p:>5} {spread:>6} {before:>10.2f} {previous:>11.2f} {rejection:>12.2f} {sort:>8.2f} "
              f"{before / rejection:>17.1f}x {before / sort:>12.1f}x {previous / rejection:>19.2f}x "
              f"{previous / sort:>14.2f}x "
              f"{float(allowed.sum(-1).float().mean()):>8.0f}  {str(inside):>14}  {difference:.1e}")


if __name__ == "__main__":
    main()
