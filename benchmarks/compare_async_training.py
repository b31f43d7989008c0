"""Synchronous vs asynchronous training on the embedded default, side by side.

Runs the quickstart (`roll run`, Ray executor, same seed and steps) once per setting and prints the
held-out greedy accuracy before and after RL, the wall-clock of the RL phase (sum of
``time/step_s``), the whole run's wall-clock, and the mean staleness of the async runs.

    python benchmarks/compare_async_training.py [--steps 200] [--ratios 0,1] [--seeds 42,1,2]
        [--request-size 64] [--async-set key=value ...] [key=value ...]

Trailing ``key=value`` overrides apply to every run; ``--async-set`` ones only to the async runs
(e.g. each scheduler at its best thread count: ``--async-set roles.actor_train.torch_threads=1``).
With several ``--seeds``, every seed runs each setting in turn and the summary compares means.

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
           "trainer.save_every=0", "trainer.resume=never", "trackers=[jsonl]", *extra]
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
    curve, elapsed = [], 0.0  # (RL seconds so far, held-out accuracy) at every evaluation
    for r in steps_rows:
        elapsed += r["time/step_s"]
        if "eval/accuracy" in r:
            curve.append((elapsed, r["eval/accuracy"]))
    return {
        "before": summary["before_rl"]["eval/accuracy"], "after": summary["after_rl"]["eval/accuracy"],
        "rl_s": elapsed, "wall_s": wall, "curve": curve,
        "staleness": sum(r.get("rollout/staleness_mean", 0.0) for r in steps_rows) / len(steps_rows),
    }


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """RL seconds until the first evaluation at or above ``target`` (None: never)."""
    return next((t for t, acc in curve if acc >= target - 1e-9), None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--ratios", default="0,1")
    ap.add_argument("--seeds", default="42", help="comma-separated; every seed runs every ratio, side by side")
    ap.add_argument("--request-size", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=0,
                    help="also evaluate every N steps and report the RL seconds each run takes to reach the "
                         "accuracy sync ends with (evaluation time is not counted as RL time)")
    ap.add_argument("--out", default="runs/compare_async")
    ap.add_argument("--report", action="store_true", help="overlay the runs' curves (roll report) in <out>/report")
    ap.add_argument("--async-set", action="append", default=[], help="a key=value override for the async runs only")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[float, list[dict]] = {r: [] for r in ratios}
    print(f"{'seed':>5} {'ratio':>5} {'before':>7} {'after':>7} {'gain pp':>8} {'RL s':>7} {'run s':>7} {'staleness':>9}")
    for seed in seeds:
        for ratio in ratios:
            r = run(Path(args.out) / f"seed_{seed}" / f"ratio_{ratio:g}", ratio, args.steps, args.request_size,
                    [f"seed={seed}", f"trainer.eval_every={args.eval_every}", *args.overrides], args.async_set)
            results[ratio].append(r)
            print(f"{seed:>5} {ratio:>5g} {r['before']:>7.1%} {r['after']:>7.1%} {100 * (r['after'] - r['before']):>8.1f} "
                  f"{r['rl_s']:>7.1f} {r['wall_s']:>7.1f} {r['staleness']:>9.2f}", flush=True)
    if args.report:
        from roll_core.report import write_report

        dirs = [Path(args.out) / f"seed_{seed}" / f"ratio_{ratio:g}" for seed in seeds for ratio in ratios]
        print(f"report: {write_report(dirs, Path(args.out) / 'report')}")
    if 0.0 not in results:
        return

    def mean(ratio, key):
        return sum(r[key] for r in results[ratio]) / len(results[ratio])

    def gain(ratio):
        return 100 * sum(r["after"] - r["before"] for r in results[ratio]) / len(results[ratio])

    if args.eval_every:
        for k, seed in enumerate(seeds):
            target = results[0.0][k]["after"]
            reach = {ratio: time_to(results[ratio][k]["curve"], target) for ratio in ratios}
            print(f"seed {seed}: RL seconds to sync's final {target:.1%}: " + ", ".join(
                f"ratio {ratio:g} {'never' if t is None else f'{t:.1f} s'}" for ratio, t in reach.items()))
    label = f"mean of {len(seeds)} seeds" if len(seeds) > 1 else f"seed {seeds[0]}"
    for ratio in ratios:
        if ratio:
            print(f"ratio {ratio:g} vs sync ({label}): RL phase {mean(0.0, 'rl_s') / mean(ratio, 'rl_s'):.2f}x faster, "
                  f"whole run {mean(0.0, 'wall_s') / mean(ratio, 'wall_s'):.2f}x, gain {gain(ratio):+.1f} vs "
                  f"{gain(0.0):+.1f} pp")


if __name__ == "__main__":
    main()
