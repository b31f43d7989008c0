"""How long a Ray run's model roles take to start: one role after the other, against side by side.

A Ray worker starts when it is spawned, and most of its start is importing torch and transformers
and building its strategy (the model, the optimizer). ``RoleGroups.model_roles`` spawns every role
a pipeline builds together before setting any up, so their processes start at once;
``RoleGroups.policy_copies`` does the same for the reference and the critic, which start from the
warmed-up policy. This script times, in one Ray cluster, alternating for ``--rounds`` rounds:

* ``one by one``: each role through ``model_role``, which spawns it and waits for its set-up (what
  every pipeline did before);
* ``side by side``: the same roles through ``model_roles``.

for two pairs: actor_train and actor_infer on workers of their own (``ray.hybrid_engine: false``,
as under the async scheduler), and PPO's reference and critic. Every worker is stopped after each
measurement, so each starts a fresh process. It prints the median seconds of each and the ratio.

    python benchmarks/bench_role_start.py [--rounds 3]

Run nothing else CPU-heavy beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from scratch import scratch_dir  # a temporary directory, removed at exit

PAIRS = {"actor_train + actor_infer": ("actor_train", "actor_infer"), "reference + critic": ("reference", "critic")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from roll_core.config import load_config
    from roll_core.embedded.model import build_tiny_model
    from roll_core.pipelines.runtime import RoleGroups
    from roll_core.plugins import get_plugins
    from roll_core.runtime import make_executor

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the workers' load bars, as roll run hides them
    model = str(build_tiny_model(f"{scratch_dir()}/model"))
    config = load_config(None, ["executor=ray", "ray.hybrid_engine=false", "roles.critic={}",
                                "algorithm.advantage_estimator=gae", "algorithm.kl_loss_coef=0.1"])
    executor = make_executor(config)
    seconds: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(args.rounds):
            for pair, names in PAIRS.items():
                # alternate which variant goes first, so that drift within a round favours neither
                for variant in (("one by one", "side by side") if r % 2 == 0 else ("side by side", "one by one")):
                    roles = RoleGroups(config, executor, get_plugins())
                    specs = [(name, model, config.role(name)) for name in names]
                    start = time.perf_counter()
                    if variant == "one by one":
                        for spec in specs:
                            roles.model_role(*spec)
                    else:
                        roles.model_roles(*specs)
                    took = time.perf_counter() - start
                    seconds.setdefault((pair, variant), []).append(took)
                    print(f"round {r}: {pair}, {variant}: {took:.2f} s", flush=True)
                    executor.kill_all()
    finally:
        executor.shutdown()
    for pair in PAIRS:
        one, both = (statistics.median(seconds[(pair, v)]) for v in ("one by one", "side by side"))
        print(f"{pair}: one by one {one:.2f} s, side by side {both:.2f} s (median of {args.rounds}): "
              f"{one / both:.2f}x as fast")


if __name__ == "__main__":
    main()
