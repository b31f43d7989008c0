"""Attention over packed rows: dense under the 4-D mask against piece by piece, side by side.

Why it matters: a packed row holds a group's prompt and several of its responses, and each response
attends to the prompt and to itself only. Dense attention computes every pair of a row's positions
and masks most of them out; :mod:`roll_core.strategies.packed_attention` computes each piece (a
prompt, a response) against its own keys only. The saving grows with the row: the score matrices are
``W^2`` per row densely, about ``length * (prompt + length / 2)`` per response by pieces.

Each contender runs the core's updater (GRPO's clipped loss, one optimizer step, one pass over the
step's samples) on the same batch with its own fresh ``hf`` trainer: "dense" with the switch to the
piece-by-piece attention turned off (``packed_attention.adopt``), "pieces" with every row by pieces,
whatever ``packed_attention.pays_off`` would pick (the last column says what it picks). They
alternate, so drift in the machine's speed falls on both; the first update of each is not counted.
Three shapes, all with random weights:

* ``tiny``: the quickstart's model (0.5M parameters) on its step: 32 prompts x 8 samples of 1-8
  tokens (mean 4, as the quickstart's are after warm-up), where attention is cheap either way;
* ``large``: the 95M model of ``large_model.py`` on ``vs_trl.py``'s large step: 8 prompts x 8
  samples, responses of 1-64 tokens (mean 48, as that model's sampled ones are);
* ``long``: the embedded architecture at hidden 256, 4 layers (about 3M parameters), 4 prompts x 8
  samples of 1-512 tokens (mean 256), rows of ``pack_max_length`` 1024 (the default);
* ``tail``: the same model and prompts with long-tailed lengths: one sample in 8 of 384-512 tokens,
  the others of 8-64.

Where a GPU is present the trainers run on it, as roll's would, and each reading waits for it.

    python benchmarks/bench_packed_attention.py [--shape tiny|large|long|tail|all] [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from scratch import scratch_dir  # a temporary directory, removed at exit

SHAPES = {  # model, prompts per step, longest response, mean response length (None: long-tailed)
    "tiny": ("tiny", 32, 8, 4.0),
    "large": ("large", 8, 64, 48.0),
    "long": ("long", 4, 512, 256.0),
    "tail": ("long", 4, 512, None),
}


def long_tailed(batch, longest: int, seed: int):
    """``batch`` with response lengths as RL's often are: one sample in 8 runs to 384-``longest``
    tokens, the others stop after 8-64."""
    import random

    rng = random.Random(seed)
    lengths = [rng.randint(384, longest) if b % 8 == 7 else rng.randint(8, 64) for b in range(len(batch))]
    width = max(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    for key in ("responses", "advantages", "infer_log_probs"):
        values = batch[key] if batch[key].shape[1] == 1 else batch[key][:, :width]
        batch.tensors[key] = values * (mask if values.shape[1] == width else mask[:, :1])
    batch.tensors["response_mask"] = mask
    return batch


def synchronize() -> None:
    """Wait for the GPU's queued work (the trainers run on CUDA where there is one), so a time counts it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    """``(seconds, fn())``, the GPU's queued work before and after counted in."""
    synchronize()
    start = time.perf_counter()
    result = fn()
    synchronize()
    return time.perf_counter() - start, result


def device_label() -> str:
    """Where the strategies compute: the GPU's name, else the CPU with this script's 2 threads."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU, 2 threads"


def build(kind: str, directory: Path) -> str:
    from large_model import build_large_model
    from roll_core.config.schema import TinyModelConfig
    from roll_core.embedded.model import build_tiny_model

    if kind == "large":
        return str(build_large_model(directory))
    if kind == "tiny":
        return str(build_tiny_model(directory / kind))
    shape = TinyModelConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024,
                            max_position_embeddings=1024)
    return str(build_tiny_model(directory / kind, shape))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from bench_packing import rl_batch
    from roll_core.algorithms.objective import ActorObjective
    from roll_core.config.schema import AlgorithmConfig, TrainRoleConfig
    from roll_core.pipelines.runtime import load_tokenizer
    from roll_core.runtime.host_memory import keep_freed_memory
    from roll_core.strategies import packed_attention
    from roll_core.strategies.hf import HFTrainStrategy
    from roll_core.strategies.packing import pack_sequences
    from roll_core.training import UpdateSpec, update

    keep_freed_memory()  # as roll's CPU workers do (runtime.reuse_freed_memory)
    objective = ActorObjective.from_config(AlgorithmConfig())
    switch, rule = packed_attention.adopt, packed_attention.pays_off
    print(f"torch {torch.__version__}, {device_label()}, medians of {args.rounds} alternating rounds after one warm-up")
    print(f"{'shape':>6} {'rows x width':>13} {'pieces':>6} {'dense s/update':>15} {'pieces s/update':>16} "
          f"{'speed-up':>8} {'default':>8}")
    for name in SHAPES if args.shape == "all" else [args.shape]:
        kind, prompts, longest, mean = SHAPES[name]
        path = build(kind, Path(scratch_dir()))
        if mean is None:
            batch = long_tailed(rl_batch(load_tokenizer(path), prompts, longest, longest - 1, args.seed), longest,
                                args.seed)
        else:
            batch = rl_batch(load_tokenizer(path), prompts, longest, mean, args.seed)
        packed = pack_sequences(batch["prompt_ids"], batch["prompt_mask"], batch["responses"], batch["response_mask"],
                                max_length=1024, pad_token_id=0)
        samples = len(batch)
        spec = UpdateSpec(max_grad_norm=1.0, micro_batch_size=samples)
        trainers = {mode: HFTrainStrategy(path, TrainRoleConfig(micro_batch_size=samples), seed=0)
                    for mode in ("dense", "pieces")}
        times: dict[str, list[float]] = {mode: [] for mode in trainers}
        try:
            for _ in range(args.rounds + 1):
                for mode, trainer in trainers.items():
                    by_pieces = mode == "pieces"
                    packed_attention.adopt = switch if by_pieces else (lambda model, config: False)
                    packed_attention.pays_off = lambda pieces, rows, width, device, by_pieces=by_pieces: by_pieces
                    times[mode].append(timed(lambda: update(trainer, batch, objective, spec))[0])
        finally:
            packed_attention.adopt, packed_attention.pays_off = switch, rule
        dense, pieces = (statistics.median(times[mode][1:]) for mode in trainers)
        rows, width = packed.input_ids.shape
        default = "pieces" if rule(packed.pieces, rows, width, trainers["dense"].device) else "dense"
        print(f"{name:>6} {f'{rows} x {width}':>13} {len(packed.pieces):>6} {dense:>15.3f} {pieces:>16.3f} "
              f"{dense / pieces:>7.2f}x {default:>8}", flush=True)


if __name__ == "__main__":
    main()
