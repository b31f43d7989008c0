"""How long a reward worker of its own takes to start on Ray, and what its process holds, without torch
against with it.

A reward worker of its own on Ray (every reward that is not lightweight under
``roles.reward.placement: auto``, any under ``workers``, and the replacement for a hung one)
computes no model: ``roll_core.runtime.reward_worker`` imports no torch, so its process loads
torch and transformers only where a reward needs them. Before, the reward worker lived in the
strategies' module, whose imports loaded both in every reward worker.
This script spawns, in one Ray cluster, alternating for ``--rounds`` rounds:

* ``without torch``: :class:`~roll_core.runtime.reward_worker.RewardWorker` with ``exact_match``;
* ``with torch``: the same worker, first importing ``roll_core.runtime.workers`` (the strategies'
  module: torch, transformers and the strategies' helpers), as every reward worker did before;

and times each from its spawn until its ``ready()`` answers, then reads its process's resident
memory. Every worker is stopped after each measurement, so each starts a fresh process. It prints
the medians and the ratios.

    python benchmarks/bench_reward_worker.py [--rounds 5]

Run nothing else CPU-heavy beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from roll_core.runtime.reward_worker import RewardWorker


class RewardWorkerWithTorch(RewardWorker):
    """A reward worker whose process first loads what the strategies' module loads."""

    def __init__(self, *args, **kwargs):
        import roll_core.runtime.workers  # noqa: F401 - torch, transformers, the strategies' helpers

        super().__init__(*args, **kwargs)


def resident_mib(pid: int) -> float:
    """The resident memory of process ``pid`` (``VmRSS``), in MiB."""
    for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from roll_core.config import load_config
    from roll_core.runtime import make_executor

    config = load_config(None, ["executor=ray"])
    executor = make_executor(config)
    variants = {"without torch": RewardWorker, "with torch": RewardWorkerWithTorch}
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    mib: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for r in range(args.rounds):
            # alternate which variant goes first, so that drift within a round favours neither
            for variant in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                start = time.perf_counter()
                group = executor.spawn("reward", variants[variant], [([("exact_match", {}, 1.0)], config)])
                executor.get(group.call("ready"))
                seconds[variant].append(time.perf_counter() - start)
                (pid,) = executor.get(group.call("pid"))
                mib[variant].append(resident_mib(pid))
                print(f"round {r}: {variant}: {seconds[variant][-1]:.2f} s, {mib[variant][-1]:.0f} MiB", flush=True)
                executor.kill_all()
    finally:
        executor.shutdown()
    (fast, slow), (small, large) = ([statistics.median(d[v]) for v in variants] for d in (seconds, mib))
    print(f"start to ready: without torch {fast:.2f} s, with torch {slow:.2f} s (median of {args.rounds}): "
          f"{slow / fast:.2f}x as fast")
    print(f"resident memory: without torch {small:.0f} MiB, with torch {large:.0f} MiB: {large / small:.2f}x as much")


if __name__ == "__main__":
    main()
