"""The weights of an engine in the trainer's process: one copy shared by trainer and engine, against
a copy of their own.

Under the hybrid engine (``ray.hybrid_engine``) actor_infer's worker lives in actor_train's process,
and on the local executor both are objects in the driver; there the ``in_process`` weight sync has
the engine compute with the trainer's own parameter tensors (``TrainStrategy.shared_parameters``,
``InferStrategy.can_share``) instead of copying them into a model of its own after every update.
This script shows what that is worth: each variant runs in a fresh child process, alternating for
``--rounds`` rounds. A child builds the trainer's worker and the engine's worker, hosted by it as
the Ray executor does (``--layout hosted``) or beside it as the local executor does (``--layout
local``), on the 95M model of ``large_model.py`` (on CUDA where there is a GPU, as a run puts it), with
the run's defaults (``runtime.cpu_matmul``, ``runtime.reuse_freed_memory``), and runs ``--steps`` steps of
what a synchronous RL step does in that process: generate 8 prompts x 8 samples of up to ``--tokens``
tokens, one training pass over them (forward, token log-probs, backward, gradient clipping, AdamW),
then the weight sync. The ``copy`` variant is the same code with the trainer's ``shared_parameters``
returning None, so the engine keeps its model and gets the buckets copied in. Printed: the process's
peak resident memory (on a GPU, the peak of CUDA memory allocated), the median seconds of a step and
of a weight sync after the first step.

    python benchmarks/bench_shared_weights.py [--layout hosted|local] [--rounds 2] [--steps 4] [--tokens 64]

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
import time
from pathlib import Path

from child_env import child_env  # PYTHONPATH with roll's code under test ahead
from scratch import scratch_dir  # a temporary directory, removed at exit

VARIANTS = ("copy", "share")
PROMPTS, SAMPLES, PROMPT_TOKENS = 8, 8, 16


class _NegativeLogLikelihood:
    """A loss with the interface ``forward_backward`` takes: the token-mean negative log-likelihood of
    the responses (the arithmetic of a policy-gradient pass, whatever its weights)."""

    outputs, temperature = ("log_probs",), 1.0

    def __call__(self, out, micro, tokens: float, samples: float):
        return -(out["log_probs"] * micro["response_mask"]).sum() / tokens, {}


def child(model: str, variant: str, layout: str, steps: int, tokens: int, threads: int) -> None:
    """Steps in this process; prints ``{"step_s": [...], "sync_s": [...], "peak_mb": ..., "bytes": ...}``."""
    import torch

    from roll_core.config import load_config
    from roll_core.data import Batch
    from roll_core.runtime.executor import LocalExecutor
    from roll_core.runtime.weight_sync import InProcessSync
    from roll_core.runtime.workers import InferWorker, TrainWorker
    from roll_core.strategies.hf import HFTrainStrategy

    if variant == "copy":
        HFTrainStrategy.shared_parameters = lambda self: None  # the engine keeps a model of its own
    cfg = load_config(None, [f"model.path={model}", "executor=local", f"torch_threads={threads}"])
    executor = LocalExecutor()
    train = executor.spawn("actor_train", TrainWorker, [("actor_train", model, cfg.roles.actor_train, cfg, 0)])
    executor.get(train.call("setup"))
    infer_args = [("actor_infer", model, cfg.roles.actor_infer, cfg, 1)]
    infer = (executor.spawn_hosted("actor_infer", InferWorker, infer_args, train) if layout == "hosted"
             else executor.spawn("actor_infer", InferWorker, infer_args))
    executor.get(infer.call("setup"))
    sync = InProcessSync(cfg, executor, train, infer, colocated=False)
    sync.setup()
    sync.update(new_version=False, wait=True)  # as a run starts: the engine gets the trainer's weights
    trainer = train.handles[0].strategy
    engine = train.handles[0].hosted["actor_infer"] if layout == "hosted" else infer.handles[0]
    cuda = trainer.device.type == "cuda"
    vocab = trainer.model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    step_s, sync_s = [], []
    for _ in range(steps):
        prompts = torch.randint(3, vocab, (PROMPTS, PROMPT_TOKENS), generator=generator).repeat_interleave(SAMPLES, 0)
        start = time.perf_counter()
        batch = engine.generate(Batch({"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts)}),
                                max_new_tokens=tokens, temperature=1.0, top_p=1.0)
        trainer.zero_grad()
        trainer.forward_backward(batch, _NegativeLogLikelihood(), micro_batch_size=len(prompts),
                                 denominators=(float(batch["response_mask"].sum()), float(len(prompts))))
        trainer.apply_gradients(1.0)
        synced = time.perf_counter()
        sync.update(new_version=True, wait=True)
        end = time.perf_counter()
        step_s.append(end - start)
        sync_s.append(end - synced)
    peak_mb = (torch.cuda.max_memory_allocated() / 2**20 if cuda
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # KiB on Linux
    print(json.dumps({"step_s": step_s, "sync_s": sync_s, "peak_mb": peak_mb, "bytes": sync.bytes_per_update,
                      "memory": "CUDA allocated" if cuda else "resident"}))


def main() -> None:
    if len(sys.argv) == 8 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3], sys.argv[4], *map(int, sys.argv[5:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", choices=("hosted", "local"), default="hosted",
                    help="the engine's worker hosted by the trainer's (Ray's hybrid engine) or beside it (local)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    from large_model import build_large_model

    model = str(build_large_model(scratch_dir("roll-bench-shared-weights-")))
    src = str(Path(__file__).resolve().parents[1] / "src")  # ahead of where the machine installed the rest
    env = child_env(src)
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS:
            out = subprocess.run([sys.executable, __file__, "--child", model, variant, args.layout, str(args.steps),
                                  str(args.tokens), str(args.threads)], capture_output=True, text=True, env=env)
            if out.returncode != 0:
                raise SystemExit(f"{variant} failed:\n{out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            results[variant].append(row)
            print(f"round {r + 1} {variant:5s}: peak {row['memory']} {row['peak_mb']:.0f} MiB, step "
                  f"{statistics.median(row['step_s'][1:]):.2f} s, sync {statistics.median(row['sync_s'][1:]):.4f} s, "
                  f"{row['bytes'] / 2**20:.0f} MiB per update", flush=True)
    summary = {v: (statistics.median(r["peak_mb"] for r in rows),
                   statistics.median(s for r in rows for s in r["step_s"][1:]),
                   statistics.median(s for r in rows for s in r["sync_s"][1:])) for v, rows in results.items()}
    print(f"{'variant':8s} {'peak MiB':>9s} {'step s':>8s} {'sync s':>8s}")
    for variant, (peak, step, synced) in summary.items():
        print(f"{variant:8s} {peak:9.0f} {step:8.2f} {synced:8.4f}")
    (copy_peak, copy_step, _), (share_peak, share_step, _) = summary["copy"], summary["share"]
    print(f"share / copy: peak memory {share_peak / copy_peak:.2f}x ({copy_peak - share_peak:.0f} MiB less), "
          f"step time {share_step / copy_step:.2f}x")


if __name__ == "__main__":
    main()
