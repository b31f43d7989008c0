"""Synchronous batch rollout against environment-level asynchronous rollout, with heavy-tailed
environment latency, side by side in one run.

Why it matters: agentic environments (simulators, sandboxes, web tools) answer in times with a long
tail. In a synchronous batch rollout every turn waits for the slowest environment of the batch; in
environment-level asynchronous rollout (``agentic.rollout: async``) each environment runs its own
loop and generation batches whatever requests are waiting, so nobody waits for a straggler's turn.

The work: FrozenLake (roll-envs) whose every ``reset`` and ``step`` first sleeps a log-normal time
(median ``--median-ms``, shape ``--sigma``: the mean is ``median * exp(sigma^2 / 2)``, the tail far
longer), played by the embedded tiny model (``hf`` engine, in this process, sampling 3 tokens per
action) on env-worker slots. A "step" takes ``--groups`` groups of ``--group-size`` episodes of up to
``--turns`` turns, then holds ``--train-s`` seconds where training would run, then updates the policy.
The modes:

* ``sync``: :func:`roll_core.agentic.episodes.play` with the turn's steps concurrent; each turn waits
  for every environment of the step;
* ``async r=0``: :class:`roll_core.agentic.async_rollout.EnvLoops`, the step's episodes each on its
  own loop, starting after the policy update (on-policy like sync);
* ``async r=1``: the same with ``rollout.async_generation_ratio=1``: the next step's groups play
  while this one trains, and a step takes the first complete groups.

It prints episodes per second of each mode (after a warm-up step), the ratios, and each mode's
slot utilisation: the environment latency its episodes summed, over wall-clock x slots. 100% is the
ideal (every environment busy all the time, latency the only cost); what is missing went to waiting
for stragglers (sync), to generation, and to the training hold (r=0).

    python benchmarks/bench_agentic_async.py [--steps 4] [--groups 8] [--group-size 8] [--sigma 1.0]
"""

from __future__ import annotations

import argparse
import math
import random
import threading
import time
from pathlib import Path

from scratch import scratch_dir  # a temporary directory, removed at exit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="measured steps per mode (one more warms up)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--median-ms", type=float, default=50.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--train-s", type=float, default=1.0, help="seconds a training step would take")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    from roll_core.agentic.async_rollout import EnvLoops, Lane, RequestBatcher
    from roll_core.agentic.episodes import Rules, engine_policy, play
    from roll_core.config.schema import InferRoleConfig
    from roll_core.embedded.model import build_tiny_model
    from roll_core.pipelines.runtime import load_tokenizer
    from roll_envs.frozen_lake import FrozenLake

    torch.set_num_threads(2)
    rng, rng_lock = random.Random(args.seed), threading.Lock()
    waited = [0.0]

    def latency() -> None:
        with rng_lock:
            s = rng.lognormvariate(math.log(args.median_ms / 1000), args.sigma)
            waited[0] += s
        time.sleep(s)

    class SlowLake(FrozenLake):
        def reset(self, seed=None):
            latency()
            return super().reset(seed)

        def step(self, action):
            latency()
            return super().step(action)

    from roll_core.strategies.hf import HFInferStrategy

    model = str(build_tiny_model(Path(scratch_dir()) / "model"))
    tokenizer = load_tokenizer(model)
    engine = HFInferStrategy(model, InferRoleConfig(), seed=args.seed)
    policy = engine_policy(engine.generate, tokenizer.pad_token_id, max_new_tokens=3, temperature=1.0, top_p=1.0)
    rules = Rules(tokenizer, max_turns=args.turns, max_length=512)
    per_step = args.groups * args.group_size
    options = {"max_steps": args.turns}

    def run_sync() -> tuple[float, int, float, int]:
        envs = [SlowLake(**options) for _ in range(per_step)]
        episodes, t0 = 0, 0.0
        for step in range(args.steps + 1):
            if step == 1:
                t0, waited[0] = time.perf_counter(), 0.0
            seeds = [step * args.groups + g for g in range(args.groups) for _ in range(args.group_size)]
            played = play(envs, seeds, seeds, policy, tokenizer, turn_format=rules.turn_format,
                          max_turns=rules.max_turns, max_length=rules.max_length, concurrent_steps=True)
            time.sleep(args.train_s)
            episodes += len(played) if step else 0
        return time.perf_counter() - t0, episodes, waited[0], per_step

    def run_async(ratio: float) -> tuple[float, int, float, int]:
        slots = math.ceil((1 + ratio) * per_step)
        batcher = RequestBatcher(policy)
        lane = Lane("slow_lake", [SlowLake(**options) for _ in range(slots)], rules, args.groups, seed_of=lambda g: g)
        loops = EnvLoops([lane], batcher, group_size=args.group_size, async_generation_ratio=ratio)
        loops.start()
        episodes, t0 = 0, 0.0
        for step in range(args.steps + 1):
            if step == 1:
                t0, waited[0] = time.perf_counter(), 0.0
            taken, _ = loops.take()
            time.sleep(args.train_s)
            with batcher.paused():
                loops.policy_updated()
            episodes += len(taken) if step else 0
        elapsed = time.perf_counter() - t0
        loops.stop()
        batcher.close()
        return elapsed, episodes, waited[0], slots

    print(f"{args.groups} groups x {args.group_size} episodes per step, up to {args.turns} turns, env latency "
          f"log-normal (median {args.median_ms:g} ms, sigma {args.sigma:g}, mean "
          f"{args.median_ms * math.exp(args.sigma ** 2 / 2):.0f} ms), {args.train_s:g} s of training per step, "
          f"{args.steps} steps measured per mode", flush=True)
    results = {}
    for name, fn in (("sync", run_sync), ("async r=0", lambda: run_async(0.0)), ("async r=1", lambda: run_async(1.0))):
        elapsed, episodes, env_seconds, slots = fn()
        results[name] = episodes / elapsed
        print(f"{name:10s} {elapsed:7.2f} s  {episodes} episodes  {results[name]:6.2f} episodes/s  {slots} slots, "
              f"utilisation {env_seconds / (elapsed * slots):.0%}", flush=True)
    for name in ("async r=0", "async r=1"):
        print(f"{name} / sync: {results[name] / results['sync']:.2f}x")


if __name__ == "__main__":
    main()
