"""Sampling throughput: roll's KV-cached loop vs `transformers` `generate`, side by side, same model.

Why it matters: rollout is a large part of RL wall-clock. The hf strategy uses its own loop (private
RNG, returns sampled log-probs); this checks it is not slower than the library's `generate`, which
returns neither the log-probs by default nor draws from a per-worker generator. A third contender
is roll's loop with transformers' default cache, which concatenates at every step, against the
cache that writes in place (`roll_core.strategies.kv_cache`). A fourth is roll's loop as the hf
engine runs it on a GPU: each decoding step replayed from a CUDA graph over a fixed batch
(`roll_core.strategies.cuda_graph`); on the CPU the same fixed batch decodes eagerly, which is why
the engine does not use it there.

EOS is suppressed so every row generates exactly ``--new-tokens`` tokens (equal work on all sides).
Prompts come in groups of 8 copies, as GRPO samples them. The contenders alternate for
``--repeats`` rounds and the median of each is printed.

``--finish`` lets rows end at EOS and leave the batch, as in RL steps, and compares how the cache
drops them: rows moved inside its buffers, as few as changed places (what roll does), against every
kept row copied into new buffers (what transformers' ``DynamicLayer`` does, and roll did before).
The same draws on both sides (the rows' order is the sampler's), so the work is equal.

    python benchmarks/bench_sampling.py                      # tiny: batch 256, 8 new tokens
    python benchmarks/bench_sampling.py --size large         # 95M parameters: batch 64, 64 new tokens
    python benchmarks/bench_sampling.py --finish             # rows end at EOS: how the cache drops them
    python benchmarks/bench_sampling.py --size large --vocab 151936 --top-p 0.9   # a real tokenizer's vocabulary
    python benchmarks/bench_sampling.py ... --keep-freed-memory   # freed memory kept, as in roll's CPU workers
    python benchmarks/bench_sampling.py --rl-step 10         # the quickstart's own generate call
    python benchmarks/bench_sampling.py ... --device cuda    # on a GPU, synchronising before each reading

``--rl-step N`` replays the generate call of the quickstart's RL step ``N`` (its policy and prompts,
captured from a local run as ``bench_hybrid.py`` does) in an inference worker in this process, against
the sampler as it was before 2026-11-26: tokens drawn by ``torch.multinomial`` and every kept row
copied when rows finish. Their draws differ, so each prints generated tokens per second over all
its calls, and the median milliseconds per call.
"""

import argparse
import contextlib
import statistics
import time
from unittest.mock import patch

import torch

import roll_core.strategies.sequences as sequences
from roll_core.strategies import cuda_graph
from roll_core.strategies.kv_cache import GrowingLayer
import bench_next_token
from bench_packed_attention import timed
from bench_token_draw import multinomial
from large_model import build_large_model
from roll_core.embedded.model import build_tiny_model
from roll_core.runtime.host_memory import keep_freed_memory
from scratch import scratch_dir  # a temporary directory, removed at exit


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=["tiny", "large"], default="tiny")
    ap.add_argument("--batch", type=int, help="rows (default 256 tiny, 64 large)")
    ap.add_argument("--new-tokens", type=int, help="tokens per row (default 8 tiny, 64 large)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--vocab", type=int, help="grow the model's vocabulary to this many entries (random rows), "
                    "as a real tokenizer's: the sampler's per-token work scales with it")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling on every side")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="keep freed memory in the process, as roll's CPU workers do (runtime.reuse_freed_memory)")
    ap.add_argument("--finish", action="store_true", help="rows end at EOS; compare how the cache drops them")
    ap.add_argument("--rl-step", type=int, help="replay the quickstart's generate call of this RL step")
    ap.add_argument("--warmup-steps", type=int, help="with --rl-step: supervised warm-up steps before RL (default: "
                    "the quickstart's; fewer capture sooner, from a less trained policy)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU (not with --rl-step)")
    args = ap.parse_args()
    if args.rl_step and args.device != "cpu":
        ap.error("--rl-step replays the quickstart's CPU worker: it takes no --device")
    if args.keep_freed_memory:
        keep_freed_memory()
    if args.rl_step:
        return rl_step(args)
    large = args.size == "large"
    batch = args.batch or (64 if large else 256)
    new_tokens = args.new_tokens or (64 if large else 8)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = scratch_dir()
    path = build_large_model(tmp) if large else build_tiny_model(tmp + "/tiny")
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    if args.vocab:
        model.resize_token_embeddings(args.vocab, mean_resizing=False)
    model.to(device)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [f"{i % 100:02d}+{(i * 7) % 100:02d}=" for i in range(batch // 8)]
    enc = tok([p for p in prompts for _ in range(8)], return_tensors="pt", add_special_tokens=False, padding=True)
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    in_place = sequences.in_place_cache

    eos = tok.eos_token_id if args.finish else -1
    tokens = []  # generated per call by roll's contenders

    def roll_loop(cache=in_place):
        sequences.in_place_cache = cache
        try:
            _, response_mask, _ = sequences.sample_responses(
                model, ids, mask, max_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                temperature=1.0, top_p=args.top_p, generator=torch.Generator(device).manual_seed(0))
            tokens.append(int(response_mask.sum()))
        finally:
            sequences.in_place_cache = in_place

    def roll_copying():
        with kept_rows_copied():
            roll_loop()

    def roll_step_before():
        with step_before():
            roll_loop()

    def roll_concat():
        roll_loop(cache=lambda past, new, dtype=None: past)  # transformers' own DynamicCache, as it comes

    def roll_graphs():  # captured on a GPU; on the CPU the fixed batch runs eagerly
        _, response_mask, _ = cuda_graph.sample_responses(
            model, ids, mask, max_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=tok.pad_token_id,
            temperature=1.0, top_p=args.top_p, generator=torch.Generator(device).manual_seed(0))
        tokens.append(int(response_mask.sum()))

    def hf_generate():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                           top_p=args.top_p, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           pad_token_id=tok.pad_token_id)

    if args.finish:
        contenders = {"roll, rows moved in place": roll_loop, "roll, kept rows copied": roll_copying}
    else:
        graphs = "roll, CUDA graphs" if device.type == "cuda" else "roll, fixed batch (eager)"
        contenders = {"roll, in-place cache": roll_loop, "roll, decoding step before": roll_step_before,
                      "roll, concatenating cache": roll_concat, graphs: roll_graphs,
                      "transformers generate": hf_generate}
    times = {name: [] for name in contenders}
    for fn in contenders.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in contenders.items():
            times[name].append(timed(fn)[0])
    params = sum(p.numel() for p in model.parameters()) / 1e6
    generated = tokens[0]  # roll's contenders draw alike: the same tokens in every call
    assert set(tokens) == {generated}, f"unequal work: {sorted(set(tokens))} tokens per call"
    vocab = model.get_output_embeddings().weight.shape[0]
    print(f"{args.size}: {params:.1f}M parameters, vocabulary {vocab}, top-p {args.top_p}, batch {batch} "
          f"({batch // 8} prompts x 8), up to {new_tokens} new tokens ({generated} generated), "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else f'{torch.get_num_threads()} threads'}, "
          f"median of {args.repeats}")
    first = next(iter(contenders))
    base = statistics.median(times[first])
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"  {name:26s} {generated / median:9.0f} tokens/s  {median * 1000:9.1f} ms  "
              f"{first} is {median / base:.2f}x faster")


def copy_kept_rows(layer, indices):
    """How the cache dropped finished rows before: every kept row copied into new buffers."""
    keys, values = layer._filled()
    indices = indices.to(layer.device)
    layer._store(keys.index_select(0, indices), values.index_select(0, indices), layer._key_buffer.shape[-2])


def kept_rows_copied():
    """The cache dropping finished rows as before 2026-11-26 (:func:`copy_kept_rows`), for a ``with`` block."""
    return patch.object(GrowingLayer, "batch_select_indices", copy_kept_rows)


def step_before():
    """The sampler's decoding step before 2026-11-27: new [B, V] tensors, a sort for top-p."""
    return patch.object(sequences, "next_tokens", bench_next_token.step_before)


@contextlib.contextmanager
def sampler_before():
    """The sampler before 2026-11-26: ``torch.multinomial`` draws, rows kept in order, kept rows copied,
    and the decoding step as it was then (:func:`step_before`)."""
    with (patch.object(sequences, "draw_tokens", multinomial),
          patch.object(sequences, "surviving_rows", lambda going: going.nonzero().squeeze(-1)),
          kept_rows_copied(), step_before()):
        yield


CALLS_PER_ROUND = 10  # --rl-step: calls of one contender before the other's


def rl_step(args) -> None:
    from bench_hybrid import capture

    from roll_core.runtime.workers import InferWorker

    calls = capture(args.rl_step, scratch_dir(), args.warmup_steps)
    init_args, init_kwargs = calls["infer"]
    worker = InferWorker(*init_args, **init_kwargs)
    worker.setup()
    worker.strategy.model.load_state_dict(calls["weights"])
    call_args, call_kwargs = calls["generate"]
    contenders = {"roll": contextlib.nullcontext, "the sampler before": sampler_before}
    seconds = {name: [] for name in contenders}
    tokens = {name: 0 for name in contenders}
    for round_ in range(args.repeats + 1):  # round 0 warms up
        for name, context in contenders.items():
            for _ in range(CALLS_PER_ROUND):
                with context():
                    start = time.perf_counter()
                    out = worker.generate(*call_args, **call_kwargs)
                    elapsed = time.perf_counter() - start
                if round_:
                    seconds[name].append(elapsed)
                    tokens[name] += int(out["response_mask"].sum())
    rows = len(call_args[0])
    print(f"the quickstart's generate call of RL step {args.rl_step}: {rows} rows, {torch.get_num_threads()} threads, "
          f"{args.repeats} rounds of {CALLS_PER_ROUND} calls each")
    rate = {name: tokens[name] / sum(seconds[name]) for name in contenders}
    for name in contenders:
        print(f"  {name:20s} {rate[name]:9.0f} tokens/s  {statistics.median(seconds[name]) * 1000:7.2f} ms per call "
              f"(median)  {tokens[name] / len(seconds[name]):6.0f} tokens per call  "
              f"roll is {rate['roll'] / rate[name]:.2f}x faster")


if __name__ == "__main__":
    main()
