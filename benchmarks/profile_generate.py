"""Where a generate call's time goes: roll's hf engine (eager, and with its CUDA graphs on a GPU)
against ``transformers``' ``generate``, in fp32 and bf16, then a torch profile of one of roll's calls.

The profile labels the model's forward (``#model_forward``) and the draw (``#next_tokens``) and
counts what makes a decoding step host-bound on a GPU: kernel launches (``cudaLaunchKernel``) and
waits for the device (``cudaStreamSynchronize``, ``aten::item``). On the H200 this showed an eager
95M step at ~385 launches with the GPU idle about 90% of the call, which led to
:mod:`roll_core.strategies.cuda_graph` (``docs/benchmarks.md``).

The engines are constructed directly, outside a worker, so cuDNN's attention stays as torch sets
it: on a Hopper GPU in bf16 it builds a plan per new shape, which roll's workers avoid
(``runtime.cudnn_attention``). Rounds alternate the contenders; the first round includes each
one's warm-up.

    python benchmarks/profile_generate.py                           # tiny, 8 new tokens
    python benchmarks/profile_generate.py --size large --new-tokens 64 --profile graphs   # on a GPU
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch

from bench_packed_attention import build, device_label, timed
from bench_packing import rl_batch
from scratch import scratch_dir  # a temporary directory, removed at exit
from roll_core.config.schema import InferRoleConfig
from roll_core.data import Batch
from roll_core.pipelines.runtime import load_tokenizer
from roll_core.strategies import sequences
from roll_core.strategies.hf import HFInferStrategy
from roll_core.strategies.models import default_device

COUNTED = ("#model_forward", "#next_tokens", "cudaLaunchKernel", "cudaStreamSynchronize", "cudaMemcpyAsync",
           "aten::item", "aten::copy_")


def labelled(label: str, fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return inner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=["tiny", "large"], default="tiny")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--profile", choices=["eager", "graphs", "none"], default="eager",
                    help="which of roll's fp32 contenders to profile (graphs: a GPU's)")
    args = ap.parse_args()
    path = build(args.size, Path(scratch_dir()))
    tokenizer = load_tokenizer(path)
    batch = rl_batch(tokenizer, 8, 8, 4.0, 0)  # 8 prompts x 8 samples, as a GRPO step
    prompts = {k: batch[k] for k in ("prompt_ids", "prompt_mask")}

    def engine(precision: str, graphs: bool) -> HFInferStrategy:
        options = {"precision": precision, "cuda_graphs": graphs}
        return HFInferStrategy(path, InferRoleConfig(strategy_options=options), seed=0)

    device = default_device()  # where the engines put their models
    on_gpu = device.type == "cuda"
    # on the CPU the engine decodes eagerly whatever the option says: no graph engines to build
    engines = {(p, g): engine(p, g) for p in ("fp32", "bf16") for g in ((False, True) if on_gpu else (False,))}
    model = engines["fp32", False].model

    def roll(precision: str, graphs: bool) -> int:
        out = engines[precision, graphs].generate(Batch(dict(prompts)), max_new_tokens=args.new_tokens,
                                                  temperature=1.0, top_p=1.0)
        return int(out["response_mask"].sum())

    def hf_generate(precision: str) -> int:
        ids, mask = (prompts[k].to(device) for k in ("prompt_ids", "prompt_mask"))
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=args.new_tokens,
                                 top_p=1.0, top_k=0, temperature=1.0, eos_token_id=engines["fp32", False].end_ids,
                                 pad_token_id=tokenizer.pad_token_id)
        return int((out[:, ids.shape[1]:] != tokenizer.pad_token_id).sum())

    contenders = {f"roll {p}": functools.partial(roll, p, False) for p in ("fp32", "bf16")}
    if on_gpu:
        contenders |= {f"roll {p} graphs": functools.partial(roll, p, True) for p in ("fp32", "bf16")}
    contenders |= {f"hf.generate {p}": functools.partial(hf_generate, p) for p in ("fp32", "bf16")}
    print(f"{device_label()}, torch {torch.__version__}, {args.size}, 64 rows, up to {args.new_tokens} new tokens",
          flush=True)
    for r in range(args.rounds):
        cells = []
        for name, fn in contenders.items():
            seconds, tokens = timed(fn)
            cells.append(f"{name} {seconds:.3f}s ({tokens} tok)")
        print(f"round {r}: " + "  ".join(cells), flush=True)
    if args.profile == "none" or (args.profile == "graphs" and not on_gpu):
        return
    forward, draw = type(model).forward, sequences.next_tokens
    type(model).forward = labelled("#model_forward", forward)  # the class's: every engine's model
    sequences.next_tokens = labelled("#next_tokens", draw)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    try:
        with torch.profiler.profile(activities=activities) as prof:
            seconds, tokens = timed(lambda: roll("fp32", args.profile == "graphs"))
    finally:
        type(model).forward, sequences.next_tokens = forward, draw
    print(f"\nroll fp32 {args.profile} generate under the profiler: {seconds:.3f}s, {tokens} tokens")
    rows = {e.key: e for e in prof.key_averages()}
    for key in COUNTED:
        if key in rows:
            e = rows[key]
            print(f"  {key:24s} count {e.count:6d}  cpu total {e.cpu_time_total / 1e3:8.1f} ms  "
                  f"self cpu {e.self_cpu_time_total / 1e3:8.1f} ms")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=55))
    if on_gpu:
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=55))


if __name__ == "__main__":
    main()
