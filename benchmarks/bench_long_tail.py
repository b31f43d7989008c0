"""Rollout with long-tailed response lengths: sync vs async vs redundant prompts, same resources.

Reasoning traces are long-tailed: most responses are short, a few run to the length limit, and a
synchronous step waits for the longest one. This script measures what the ``async`` scheduler
recovers, by running the real RLVR pipeline (Ray, the real schedulers, reward workers and trainer
on the tiny model) with a *simulated* inference engine in place of ``hf``:

* ``sim_engine`` (registered by a throwaway plugin this script writes to a temporary directory)
  draws each sample's length from a log-normal distribution (``--median`` tokens, ``--sigma``),
  capped at ``rollout.max_new_tokens``, and models continuous batching: a request of any size
  returns after ``max(length) * --ms-per-token``, and a worker serves up to
  ``rollout.max_running_requests`` requests at once. The engine's capacity is the same in every
  setting: ``2 workers x 64 samples`` in flight.

Settings (one seed, ``--steps`` RL steps each, throughput over the steps after the first two):

* ``sync``: each worker's 64 samples as one request; the step waits for its longest sample.
* ``async r=0 +redundant``: on-policy; group requests, 25% extra groups in flight, the batch takes
  the first groups to finish (stragglers are dropped when the weights change).
* ``async r=1``: generation of step n+1 runs while step n trains (staleness <= 1).
* ``async r=1 +redundant``: both.
* ``async r=1 +redundant, per sample``: both, with every sample its own request
  (``request_size=1``, 64 requests in flight per worker): an engine slot frees as soon as its sample
  ends instead of when the longest sample of its group does.

    python benchmarks/bench_long_tail.py [--steps 12] [--ms-per-token 40] [--median 6] [--sigma 1.0]

With ``--engine vllm`` the same settings run on the real vLLM engine (roll-vllm) instead of the
simulation: response lengths are then the tiny model's own (no warm-up, so it stops at EOS after a
long-tailed number of tokens), decoding costs real CPU time shared with the trainer, and one engine
worker holds the capacity (128 samples in flight), since two engines on 2 cores only contend:

    python benchmarks/bench_long_tail.py --engine vllm [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from child_env import child_env  # PYTHONPATH with roll's code under test ahead
from scratch import scratch_dir  # a temporary directory, removed at exit

ENGINE = '''
"""A simulated inference engine with long-tailed response lengths (for benchmarks/bench_long_tail.py)."""
import math, os, time

import torch

from roll_core import hookimpl
from roll_core.strategies.hf import HFInferStrategy
from roll_core.strategy import request_cancelled


class SimEngine(HFInferStrategy):
    concurrent_requests = True  # continuous batching: requests on one worker overlap

    def generate(self, batch, *, max_new_tokens, temperature, top_p):
        n = len(batch)
        mu, sigma = math.log(float(os.environ["SIM_MEDIAN"])), float(os.environ["SIM_SIGMA"])
        g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=self.generator)))
        lengths = (torch.randn(n, generator=g) * sigma + mu).exp().round().clamp(1, max_new_tokens).long()
        if temperature == 0:  # evaluation: short, fixed answers
            lengths = torch.ones(n, dtype=torch.long)
        for _ in range(int(lengths.max())):  # one decoding step per token; an aborted request stops
            if request_cancelled():
                break
            time.sleep(float(os.environ["SIM_MS_PER_TOKEN"]) / 1000)
        width = int(lengths.max())
        steps = torch.arange(width)[None, :]
        mask = (steps < lengths[:, None]).long()
        eos = self.model.config.eos_token_id
        tokens = torch.randint(20, 60, (n, width), generator=g)
        tokens = torch.where(steps == lengths[:, None] - 1, torch.full_like(tokens, eos), tokens)
        tokens = tokens * mask
        logp = torch.full((n, width), -math.log(self.model.config.vocab_size)) * mask
        return batch.update(responses=tokens, response_mask=mask, infer_log_probs=logp)


@hookimpl
def roll_register_strategies(register):
    register("sim_engine", "roll_bench_sim_engine:SimEngine", kind="infer",
             description="simulated continuous-batching engine with log-normal response lengths")
'''

SETTINGS = {
    "sync": ["rollout.scheduler=sync"],
    "async r=0 +redundant": ["rollout.scheduler=async", "rollout.async_generation_ratio=0",
                             "rollout.max_additional_running_prompts=4"],
    "async r=1": ["rollout.scheduler=async", "rollout.async_generation_ratio=1"],
    "async r=1 +redundant": ["rollout.scheduler=async", "rollout.async_generation_ratio=1",
                             "rollout.max_additional_running_prompts=4"],
    "async r=1 +redundant, per sample": ["rollout.scheduler=async", "rollout.async_generation_ratio=1",
                                         "rollout.max_additional_running_prompts=4", "rollout.request_size=1",
                                         "rollout.max_running_requests=64"],
}


def plugin_dir() -> Path:
    root = Path(scratch_dir(prefix="roll-sim-engine-"))
    (root / "roll_bench_sim_engine.py").write_text(textwrap.dedent(ENGINE))
    info = root / "roll_bench_sim_engine-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: roll-bench-sim-engine\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[roll]\nsim_engine = roll_bench_sim_engine\n")
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ms-per-token", type=float, default=40)
    ap.add_argument("--median", type=float, default=6)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--engine", choices=["sim", "vllm"], default="sim")
    args = ap.parse_args()
    site = plugin_dir()
    env = child_env(site, SIM_MEDIAN=str(args.median), SIM_SIGMA=str(args.sigma), SIM_MS_PER_TOKEN=str(args.ms_per_token))
    if args.engine == "vllm":
        engine = ["roles.actor_infer.strategy=vllm", "roles.actor_infer.num_workers=1",
                  "roles.actor_infer.strategy_options.max_model_len=64"]
        async_capacity = ["rollout.request_size=8", "rollout.max_running_requests=16"]
        per_sample_capacity = ["rollout.max_running_requests=128"]
    else:
        engine = ["roles.actor_infer.strategy=sim_engine", "roles.actor_infer.num_workers=2"]
        async_capacity = ["rollout.request_size=8", "rollout.max_running_requests=8"]
        per_sample_capacity = []
    common = [*engine, "roles.reward.num_workers=2",
              "rollout.prompts_per_step=16", "rollout.num_return_sequences=8",
              f"rollout.max_new_tokens={args.max_new_tokens}", "warmup.steps=0", "data.options.num_eval=1",
              "trainer.eval_every=0", "trainer.save_every=0", "trackers=[jsonl]", "torch_threads=1",
              f"trainer.max_steps={args.steps}"]
    # Same engine capacity everywhere: with sim, 64 samples in flight per worker (one 64-sample
    # request for sync, eight 8-sample group requests for async); with vllm, 128 on its one worker.
    rows = {}
    with tempfile.TemporaryDirectory() as out:
        for name, overrides in SETTINGS.items():
            run_dir = Path(out) / re.sub(r"\W", "", name.replace(" ", "_"))
            extra = async_capacity if "async" in name else []
            late = per_sample_capacity if "per sample" in name else []  # after the setting's own 64
            cmd = [sys.executable, "-m", "roll_core.cli", "run", f"output_dir={run_dir}",
                   *common, *extra, *overrides, *late]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
            steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            steps = [s for s in steps if s["step"] > 2]
            seconds = sum(s["time/step_s"] for s in steps)
            samples = 16 * 8 * len(steps)
            rows[name] = {
                "samples_per_s": samples / seconds,
                "step_s": statistics.mean(s["time/step_s"] for s in steps),
                "rollout_s": statistics.mean(s["time/rollout_s"] for s in steps),
                "train_s": statistics.mean(s["time/train_s"] for s in steps),
                "len": statistics.mean(s["response_length/mean"] for s in steps),
                "stale": statistics.mean(s.get("rollout/staleness_mean", 0.0) for s in steps),
            }
            print(f"  {name}: done", flush=True)
    base = rows["sync"]["samples_per_s"]
    if args.engine == "vllm":
        print(f"vLLM engine, the tiny model's own lengths (cap {args.max_new_tokens}), 1 engine worker x 128 "
              f"samples in flight, 128 samples/step, steps 3..{args.steps}")
    else:
        print(f"log-normal lengths (median {args.median:g}, sigma {args.sigma:g}, cap {args.max_new_tokens}), "
              f"{args.ms_per_token:g} ms/token, 2 engine workers x 64 samples in flight, 128 samples/step, "
              f"steps 3..{args.steps}")
    print(f"{'setting':<36}{'samples/s':>10}{'speed-up':>10}{'step s':>9}{'rollout s':>11}{'train s':>9}"
          f"{'mean len':>10}{'staleness':>11}")
    for name, r in rows.items():
        print(f"{name:<36}{r['samples_per_s']:>10.1f}{r['samples_per_s'] / base:>9.2f}x{r['step_s']:>9.2f}"
              f"{r['rollout_s']:>11.2f}{r['train_s']:>9.2f}{r['len']:>10.1f}{r['stale']:>11.2f}")


if __name__ == "__main__":
    main()
