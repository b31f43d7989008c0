"""Scoring while generating: rollout time with and without request streaming, in two settings.

* ``sandbox``: examples/multi_domain.yaml, whose code domain runs every program in the sandbox, a
  CPU-bound reward on the same cores as generation;
* ``latency``: the embedded arithmetic task scored by a latency-bound reward (``--latency-ms`` per
  sample, waiting rather than computing, as a remote judge or sandbox service does), through the
  ``trl_function`` adapter.

Each setting runs twice on Ray with the same seed and steps (no warm-up, no evaluation):
``request_size=null`` sends each inference worker's whole share as one request, so scoring starts
when generation ends; ``request_size=N`` scores each N-sample request while the next generates.
The script prints the mean rollout time per step, the scoring time left after the last generation
(``time/reward_wait_s``) and the rollout speed-up of streaming.

    python benchmarks/bench_reward_overlap.py [--steps 8] [--request-size 32] [--latency-ms 10]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from child_env import child_env  # PYTHONPATH with roll's code under test ahead

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "multi_domain.yaml"


def slow_exact_match(prompts, completions, ground_truth, **columns):
    """A latency-bound reward (TRL signature): waits LATENCY_MS per sample, then exact match."""
    time.sleep(float(os.environ.get("BENCH_LATENCY_MS", "10")) / 1000 * len(completions))
    return [float(c.strip() == t) for c, t in zip(completions, ground_truth)]


SETTINGS = {
    "sandbox": [str(CONFIG), "data.domains.arithmetic.options.num_eval=1", "data.domains.code.options.num_eval=1"],
    "latency": ["roles.reward.name=trl_function", "roles.reward.options.function=bench_reward_overlap:slow_exact_match",
                "roles.reward.num_workers=2", "data.options.num_eval=1"],
}


def run(out: Path, setting: str, request_size: str, steps: int, latency_ms: float) -> dict[str, float]:
    cmd = [sys.executable, "-m", "roll_core.cli", "run", *SETTINGS[setting], f"output_dir={out}", "warmup.steps=0",
           f"trainer.max_steps={steps}", "trainer.eval_every=0", "trainer.save_every=0", "trainer.resume=never",
           "trackers=[jsonl]", f"rollout.request_size={request_size}"]
    # Ray workers inherit PYTHONPATH (and ROLL_ variables), so they can import this file's reward.
    here = str(Path(__file__).resolve().parent)
    env = child_env(here, BENCH_LATENCY_MS=str(latency_ms))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"run failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/rollout_s" in r][1:]  # the first step pays for start-up
    keys = ("time/rollout_s", "time/generate_s", "time/reward_s", "time/reward_wait_s", "time/step_s")
    return {k: statistics.mean(r[k] for r in rows) for k in keys}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--request-size", default="32")
    ap.add_argument("--latency-ms", type=float, default=10.0)
    ap.add_argument("--settings", default="sandbox,latency")
    ap.add_argument("--out", default="runs/bench_reward_overlap")
    args = ap.parse_args()
    print(f"{'setting':<9} {'scoring':<16} {'rollout s':>10} {'generate s':>11} {'reward s':>9} "
          f"{'reward wait s':>14} {'step s':>7}")
    for setting in args.settings.split(","):
        results = {}
        for label, size in (("after generation", "null"), (f"streamed ({args.request_size})", args.request_size)):
            r = results[label] = run(Path(args.out) / setting / size, setting, size, args.steps, args.latency_ms)
            print(f"{setting:<9} {label:<16} {r['time/rollout_s']:>10.2f} {r['time/generate_s']:>11.2f} "
                  f"{r['time/reward_s']:>9.2f} {r['time/reward_wait_s']:>14.2f} {r['time/step_s']:>7.2f}", flush=True)
        base, streamed = results.values()
        print(f"{setting:<9} rollout speed-up from scoring while generating: "
              f"{base['time/rollout_s'] / streamed['time/rollout_s']:.2f}x "
              f"(step: {base['time/step_s'] / streamed['time/step_s']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
