"""Every recipe in examples/recipes/ on the embedded task, side by side, same seed and budget.

Each recipe runs as its own `roll run` (local executor) from the same warmed-up starting point
(the warm-up is seeded, so every run imitates the same teacher identically) for the same number of
RL steps, and the script prints held-out greedy accuracy before and after RL, the gain, the wall
time and, for PPO, the critic's value loss at the first and last step.

    python benchmarks/compare_recipes.py [--steps 80] [--only grpo,ppo] [--out runs/recipes] [--report]

``--report`` also overlays every recipe's curves with ``roll report`` into ``<out>/report/``.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "recipes"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--only", default="", help="comma-separated recipe names (default: all)")
    ap.add_argument("--out", default="runs/recipes")
    ap.add_argument("--report", action="store_true", help="overlay the runs' curves (roll report) in <out>/report")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or sorted(p.stem for p in RECIPES.glob("*.yaml"))
    rows = []
    for name in names:
        out = Path(args.out) / name
        cmd = [sys.executable, "-m", "roll_core.cli", "run", str(RECIPES / f"{name}.yaml"), f"output_dir={out}",
               "executor=local", f"trainer.max_steps={args.steps}", "trainer.eval_every=0",
               "trainer.save_every=0", "trainer.resume=never", "trackers=[jsonl]"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print(f"{name}: failed\n{proc.stderr[-2000:]}", flush=True)
            continue
        summary = json.loads((out / "summary.json").read_text())
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        before, after = summary["before_rl"]["eval/accuracy"], summary["after_rl"]["eval/accuracy"]
        value = [m["critic/value_loss"] for m in metrics if "critic/value_loss" in m]
        rows.append((name, before, after, wall, value))
        extra = f"  value loss {value[0]:.4f} -> {value[-1]:.4f}" if value else ""
        print(f"{name:22s} {before:6.1%} -> {after:6.1%}  ({100 * (after - before):+5.1f} pp)  {wall:6.0f} s{extra}",
              flush=True)
    print(f"\n| recipe | before RL | after {args.steps} steps | gain (pp) | wall (s) |")
    print("|---|---|---|---|---|")
    for name, before, after, wall, _ in rows:
        print(f"| {name} | {before:.1%} | {after:.1%} | {100 * (after - before):+.1f} | {wall:.0f} |")
    if args.report and rows:
        from roll_core.report import write_report

        print(f"\nreport: {write_report([Path(args.out) / name for name, *_ in rows], Path(args.out) / 'report')}")


if __name__ == "__main__":
    main()
