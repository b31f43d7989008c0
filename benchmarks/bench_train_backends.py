"""Training backends side by side: seconds per train step and peak memory per rank.

Why it matters: the backend is a config value, so a user should know what each one costs on the
same work. Every backend trains the same ~100M-parameter model (the embedded architecture at 14
layers, hidden 768, random weights, built here; no download) on the same batch with the core's
updater and the same PPO loss, in 2 processes over gloo (one thread each, as on this 2-core
machine): ``hf`` and ``fsdp2`` and ``deepspeed`` (ZeRO-2, ZeRO-3) as two data-parallel ranks,
``megatron`` as TP=2. The backends run one after another in fresh processes, so none competes with
another for the cores; the first step (allocation, warm-up) is not counted.

Peak memory is each rank's peak resident set (``ru_maxrss``): model, gradients, optimizer states
and activations, plus the interpreter and libraries (about the same for all; the ``after build``
column shows it with the model and optimizer in place, before any step).

    python benchmarks/bench_train_backends.py [--steps 3] [--rows 16] [--backends hf,fsdp2,zero2,zero3,megatron_tp2]

Needs roll-deepspeed and roll-megatron installed beside roll-core.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.multiprocessing as mp
from scratch import scratch_dir  # a temporary directory, removed at exit

BACKENDS = {
    "hf": ("hf", {}),
    "fsdp2": ("fsdp2", {}),
    "zero2": ("deepspeed", {"zero_stage": 2}),
    "zero3": ("deepspeed", {"zero_stage": 3}),
    "megatron_tp2": ("megatron", {"tensor_parallel_size": 2}),
}


def _batch(rows: int, vocab: int, prompt: int = 32, response: int = 32):
    from roll_core.data import Batch

    g = torch.Generator().manual_seed(0)
    mask = torch.ones(rows, response)
    return Batch({
        "prompt_ids": torch.randint(3, vocab, (rows, prompt), generator=g),
        "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
        "responses": torch.randint(3, vocab, (rows, response), generator=g),
        "response_mask": mask.long(), "loss_mask": mask,
        "old_log_probs": -torch.rand(rows, response, generator=g) * 3,
        "advantages": torch.randn(rows, response, generator=g),
    })


def _rank(rank: int, world: int, port: int, model: str, backend: str, steps: int, rows: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from roll_core.algorithms.objective import ActorObjective
    from roll_core.config import load_config
    from roll_core.plugins import get_plugins
    from roll_core.training import UpdateSpec, update

    strategy, options = BACKENDS[backend]
    cfg = load_config(None, [f"roles.actor_train.strategy={strategy}", f"roles.actor_train.num_workers={world}",
                             f"roles.actor_train.strategy_options={options}", "roles.actor_train.micro_batch_size=4"])
    trainer = get_plugins().train_strategies.get(strategy)(model, cfg.roles.actor_train, 0)
    built_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    dp_rank, dp_size = trainer.data_parallel()
    batch = _batch(rows, 98).chunk(dp_size)[dp_rank]
    loss_fn = ActorObjective.from_config(cfg.algorithm, cfg.rollout)
    spec = UpdateSpec(max_grad_norm=1.0, micro_batch_size=4)
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        update(trainer, batch, loss_fn, spec)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.put((rank, statistics.median(times[1:]), built_rss, peak))
    dist.destroy_process_group()


def measure(model: str, backend: str, steps: int, rows: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=_rank, args=(r, 2, port, model, backend, steps, rows, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    return {"step_s": max(r[1] for r in results), "built_mib": max(r[2] for r in results),
            "peak_mib": max(r[3] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=16, help="samples per step (both ranks together)")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    args = parser.parse_args()
    from roll_core.embedded.model import TinyModelConfig, build_tiny_model

    model = str(build_tiny_model(scratch_dir() + "/model", TinyModelConfig(
        hidden_size=768, num_layers=14, num_heads=12, intermediate_size=2048, max_position_embeddings=128)))
    from safetensors.torch import load_file

    params = sum(t.numel() for t in load_file(model + "/model.safetensors").values())
    print(f"model: {params / 1e6:.0f}M parameters, {args.rows} samples x 64 tokens per step, 2 processes x 1 thread")
    results = {}
    for backend in args.backends.split(","):
        results[backend] = measure(model, backend, args.steps, args.rows)
        r = results[backend]
        print(f"  {backend:<13} {r['step_s']:7.2f} s/step  peak {r['peak_mib']:7.0f} MiB/rank "
              f"(after build {r['built_mib']:.0f})", flush=True)
    base = results.get("hf")
    if base:
        print("\nbackend        s/step  vs hf   peak MiB/rank  vs hf")
        for backend, r in results.items():
            print(f"{backend:<13} {r['step_s']:7.2f} {r['step_s'] / base['step_s']:6.2f}x {r['peak_mib']:10.0f} "
                  f"{r['peak_mib'] / base['peak_mib']:8.2f}x")


if __name__ == "__main__":
    main()
