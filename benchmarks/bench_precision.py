"""fp32 against bf16 autocast (``strategy_options.precision``), side by side, on a role's own work.

Why it matters: a matrix product in bfloat16 runs about twice as fast as in float32 where the
processor has bfloat16 instructions (GPUs; CPUs with AVX-512 BF16 or AMX), and an RL step is
matrix products. :mod:`roll_core.strategies.precision` runs the ``hf`` strategies' forward passes
under ``torch.autocast``; the weights, gradients and optimizer stay float32.

Two contenders per precision, fresh each: an ``hf`` trainer running the core's updater (GRPO's
clipped loss, one optimizer step, one pass over the samples) and an ``hf`` inference strategy
generating for the same prompts. They alternate, so drift in the machine's speed falls on both; the
first round is not counted. Shapes, with random weights:

* ``tiny``: the quickstart's model (0.5M parameters), 32 prompts x 8 samples, responses of 1-8
  tokens (mean 4) to train on, 8 new tokens to generate;
* ``large``: the 95M model of ``large_model.py`` on ``vs_trl.py``'s large step: 8 prompts x 8
  samples, responses of 1-64 tokens (mean 48) to train on, 64 new tokens to generate.

Generation is reported per generated token (sampled lengths differ a little between precisions).
The last column is how far bf16's log-probs of the update's batch are from fp32's (mean absolute
difference over response tokens).

    python benchmarks/bench_precision.py [--shape tiny|large|all] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from scratch import scratch_dir  # a temporary directory, removed at exit

SHAPES = {  # model, prompts per step, longest response, mean response length
    "tiny": ("tiny", 32, 8, 4.0),
    "large": ("large", 8, 64, 48.0),
}
PRECISIONS = ("fp32", "bf16")


def hf_roles(path: str, rows: int, precisions=PRECISIONS, trained=PRECISIONS):
    """roll's ``hf`` engine at each of ``precisions`` and trainer at each of ``trained``, and what one
    update of ``rows`` samples takes besides (the default actor objective, one micro-batch):
    ``(trainers, engines, objective, spec)``, the trainers and engines keyed by precision."""
    from roll_core.algorithms.objective import ActorObjective
    from roll_core.config.schema import AlgorithmConfig, InferRoleConfig, TrainRoleConfig
    from roll_core.strategies.hf import HFInferStrategy, HFTrainStrategy
    from roll_core.training import UpdateSpec

    trainers = {p: HFTrainStrategy(path, TrainRoleConfig(micro_batch_size=rows, strategy_options={"precision": p}),
                                   seed=0) for p in trained}
    engines = {p: HFInferStrategy(path, InferRoleConfig(strategy_options={"precision": p}), seed=0)
               for p in precisions}
    return trainers, engines, ActorObjective.from_config(AlgorithmConfig()), UpdateSpec(max_grad_norm=1.0,
                                                                                         micro_batch_size=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from bench_packed_attention import build, device_label, timed
    from bench_packing import rl_batch
    from roll_core.data import Batch
    from roll_core.pipelines.runtime import load_tokenizer
    from roll_core.runtime.host_memory import keep_freed_memory
    from roll_core.strategies import cudnn_attention
    from roll_core.training import update

    keep_freed_memory()  # as roll's CPU workers do (runtime.reuse_freed_memory)
    cudnn_attention.configure(False)  # as roll's workers do on a GPU (runtime.cudnn_attention)
    print(f"torch {torch.__version__}, {device_label()}, medians of {args.rounds} alternating rounds after one warm-up")
    print(f"{'shape':>6} {'fp32 s/update':>14} {'bf16 s/update':>14} {'speed-up':>8} {'fp32 tok/s':>11} "
          f"{'bf16 tok/s':>11} {'speed-up':>8} {'|dlogp|':>8}")
    for name in SHAPES if args.shape == "all" else [args.shape]:
        kind, prompts, longest, mean = SHAPES[name]
        path = build(kind, Path(scratch_dir()))
        batch = rl_batch(load_tokenizer(path), prompts, longest, mean, args.seed)
        prompts_only = {key: batch[key] for key in ("prompt_ids", "prompt_mask")}  # generate() fills in a batch
        trainers, engines, objective, spec = hf_roles(path, len(batch))
        log_probs = {p: trainers[p].compute_log_probs(batch, 1.0) for p in PRECISIONS}
        drift = float((log_probs["bf16"] - log_probs["fp32"]).abs().sum() / batch["response_mask"].sum())
        updates: dict[str, list[float]] = {p: [] for p in PRECISIONS}
        rates: dict[str, list[float]] = {p: [] for p in PRECISIONS}
        for _ in range(args.rounds + 1):
            for p in PRECISIONS:
                seconds, _ = timed(lambda: update(trainers[p], batch, objective, spec))
                updates[p].append(seconds)
                seconds, out = timed(lambda: engines[p].generate(Batch(dict(prompts_only)), max_new_tokens=longest,
                                                                 temperature=1.0, top_p=1.0))
                rates[p].append(float(out["response_mask"].sum()) / seconds)
        (u32, u16), (r32, r16) = ([statistics.median(d[p][1:]) for p in PRECISIONS] for d in (updates, rates))
        print(f"{name:>6} {u32:>14.3f} {u16:>14.3f} {u32 / u16:>7.2f}x {r32:>11.0f} {r16:>11.0f} {r16 / r32:>7.2f}x "
              f"{drift:>8.4f}", flush=True)


if __name__ == "__main__":
    main()
