"""Synchronous vs asynchronous training on the embedded default, side by side.

Runs the quickstart (`roll run`, Ray executor, same seed and steps) once per setting and prints the
held-out greedy accuracy before and after RL, the wall-clock of the RL phase (sum of
``time/step_s``), the whole run's wall-clock, and the mean staleness of the async runs.

    python benchmarks/compare_async_training.py [--steps 200] [--ratios 0,1] [--request-size 64]
        [--async-set key=value ...] [key=value ...]

Trailing ``key=value`` overrides apply to every run; ``--async-set`` ones only to the async runs
(e.g. each scheduler at its best thread count: ``--async-set torch_threads=1``).

``ratio 0`` is the ``sync`` scheduler; ``ratio r > 0`` is ``rollout.scheduler=async`` with
``rollout.async_generation_ratio=r``.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def run(out: Path, ratio: float, steps: int, request_size: int, extra: list[str], async_extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "roll_core.cli", "run", f"output_dir={out}", f"trainer.max_steps={steps}",
           "trainer.eval_every=0", "trainer.save_every=0", "trainer.resume=never", "trackers=[jsonl]", *extra]
    if ratio > 0:
        cmd += ["rollout.scheduler=async", f"rollout.async_generation_ratio={ratio}",
                f"rollout.request_size={request_size}", *async_extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"ratio {ratio} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "time/step_s" in r]
    return {
        "before": summary["before_rl"]["eval/accuracy"], "after": summary["after_rl"]["eval/accuracy"],
        "rl_s": sum(r["time/step_s"] for r in steps_rows), "wall_s": wall,
        "staleness": sum(r.get("rollout/staleness_mean", 0.0) for r in steps_rows) / len(steps_rows),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--ratios", default="0,1")
    ap.add_argument("--request-size", type=int, default=64)
    ap.add_argument("--out", default="runs/compare_async")
    ap.add_argument("--async-set", action="append", default=[], help="a key=value override for the async runs only")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args()
    results = {}
    print(f"{'ratio':>5} {'before':>7} {'after':>7} {'gain pp':>8} {'RL s':>7} {'run s':>7} {'staleness':>9}")
    for ratio in [float(r) for r in args.ratios.split(",")]:
        r = results[ratio] = run(Path(args.out) / f"ratio_{ratio:g}", ratio, args.steps, args.request_size,
                                 args.overrides, args.async_set)
        print(f"{ratio:>5g} {r['before']:>7.1%} {r['after']:>7.1%} {100 * (r['after'] - r['before']):>8.1f} "
              f"{r['rl_s']:>7.1f} {r['wall_s']:>7.1f} {r['staleness']:>9.2f}", flush=True)
    if 0.0 in results:
        base = results[0.0]
        for ratio, r in results.items():
            if ratio:
                print(f"ratio {ratio:g} vs sync: RL phase {base['rl_s'] / r['rl_s']:.2f}x faster, "
                      f"whole run {base['wall_s'] / r['wall_s']:.2f}x, gain {100 * (r['after'] - r['before']):+.1f} "
                      f"vs {100 * (base['after'] - base['before']):+.1f} pp")


if __name__ == "__main__":
    main()
