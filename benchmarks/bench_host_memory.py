"""CPU updates with glibc's default allocator behaviour against freed memory kept for reuse.

``runtime.reuse_freed_memory`` (:mod:`roll_core.runtime.host_memory`) keeps the memory a CPU worker
frees in its process instead of handing it back to the kernel, which would zero-fill it again page by
page in the next step. This script shows what that is worth on the machine it runs on: each variant
runs in a fresh child process (the allocator's settings are per process), alternating for
``--rounds`` rounds; a child loads the 95M model of ``large_model.py`` with roll's kernel choice for
its linear layers (``runtime.cpu_matmul: auto``) and runs training passes over 64 samples at the
widths an RL step's batches have (prompt plus response, varying from step to step): forward,
token log-probs, backward, gradient clipping, AdamW. It prints the median seconds of the passes after
the first, the minor page faults per pass and the process's peak resident memory.

``--threads-too`` adds two variants that run the same passes, memory kept, in a thread other than
the process's main one, as the controller inside the worker (``runtime/controller.py``) runs its
pipeline: once with glibc's default arenas (such a thread gets an arena of its own, whose heaps are
capped at 64 MiB, so a larger block is mmap'ed whatever ``mallopt`` says) and once with
``MALLOC_ARENA_MAX=1`` (every thread on the main heap), which is what the hosted run sets.

    python benchmarks/bench_host_memory.py [--rounds 2] [--widths 60 45 64 50 58 40 62 52] [--threads 2]
    python benchmarks/bench_host_memory.py --rounds 1 --threads-too

Run nothing else CPU-heavy beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from scratch import scratch_dir  # a temporary directory, removed at exit

# name: (memory kept, passes in a thread of their own, extra environment of the child process)
VARIANTS = {"glibc default": (False, False, {}), "reuse_freed_memory": (True, False, {})}
THREAD_VARIANTS = {"reuse, in a thread": (True, True, {}),
                   "reuse, thread, 1 arena": (True, True, {"MALLOC_ARENA_MAX": "1"})}


def child(model: str, reuse: bool, widths: list[int], threads: int) -> None:
    """Training passes in this process; prints ``{"seconds": [...], "faults": [...], "peak_mb": ...}``.
    Page faults are counted for the whole process (``RUSAGE_SELF``): the passes are all it does."""
    import torch
    from transformers import AutoModelForCausalLM

    from roll_core.runtime import host_memory
    from roll_core.strategies import cpu_matmul

    if reuse and not host_memory.keep_freed_memory():
        raise SystemExit("this C library is not glibc: nothing to compare")
    torch.set_num_threads(threads)
    cpu_matmul.configure("auto")
    model_ = AutoModelForCausalLM.from_pretrained(model)
    cpu_matmul.adopt(model_)
    optimizer = torch.optim.AdamW(model_.parameters(), lr=1e-5)
    generator = torch.Generator().manual_seed(0)
    seconds, faults = [], []
    for width in widths:
        ids = torch.randint(3, 90, (64, width), generator=generator)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        logits = model_(input_ids=ids).logits[:, :-1].float()
        log_probs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (-log_probs.mean()).backward()
        torch.nn.utils.clip_grad_norm_(model_.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "faults": faults, "peak_mb": peak_mb}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--widths", type=int, nargs="+", default=[60, 45, 64, 50, 58, 40, 62, 52])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--threads-too", action="store_true",
                        help="also run the passes in a thread of their own, with and without MALLOC_ARENA_MAX=1")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # model directory, 0 | 1 | thread
    args = parser.parse_args()
    if args.child:
        passes = (args.child[0], args.child[1] != "0", args.widths, args.threads)
        if args.child[1] == "thread":  # the thread's first allocation gives it an arena of its own (glibc)
            worker = threading.Thread(target=child, args=passes, name="passes")
            worker.start()
            worker.join()
        else:
            child(*passes)
        return
    from large_model import build_large_model

    model = build_large_model(Path(scratch_dir(prefix="roll-host-memory-")))
    variants = {**VARIANTS, **(THREAD_VARIANTS if args.threads_too else {})}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        for name, (reuse, in_thread, env) in variants.items():
            how = "thread" if in_thread else str(int(reuse))
            cmd = [sys.executable, __file__, "--child", str(model), how, "--threads", str(args.threads),
                   "--widths", *map(str, args.widths)]
            result = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, **env})
            run = json.loads(result.stdout.strip().splitlines()[-1])
            runs[name].append(run)
            print(f"round {round_ + 1} {name:<24} passes " + " ".join(f"{s:.2f}" for s in run["seconds"]), flush=True)
    print(f"\n95M model, 64 samples per pass, widths {args.widths}, {args.threads} threads; "
          f"passes 2-{len(args.widths)} of {args.rounds} round(s)")
    print(f"{'variant':<24}{'median s/pass':>14}{'faults/pass':>13}{'peak MB':>9}")
    medians = {}
    for name, rs in runs.items():
        medians[name] = statistics.median(s for r in rs for s in r["seconds"][1:])
        faults = statistics.median(f for r in rs for f in r["faults"][1:])
        peak = max(r["peak_mb"] for r in rs)
        print(f"{name:<24}{medians[name]:>14.2f}{faults:>13.0f}{peak:>9.0f}")
    comparisons = [("reuse_freed_memory", "glibc default", "reuse_freed_memory")]
    if args.threads_too:
        comparisons.append(("in a thread, MALLOC_ARENA_MAX=1", "reuse, in a thread", "reuse, thread, 1 arena"))
    for label, slow, fast in comparisons:
        pairs = [statistics.median(a["seconds"][1:]) / statistics.median(b["seconds"][1:])
                 for a, b in zip(runs[slow], runs[fast])]
        print(f"{label}: {medians[slow] / medians[fast]:.2f}x faster per pass "
              f"(round by round: {' '.join(f'{p:.2f}x' for p in pairs)})")


if __name__ == "__main__":
    main()
