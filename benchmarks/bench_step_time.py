"""Seconds per RL step of the quickstart: an earlier commit against the working tree, side by side.

Refactors of the core must not slow the main job down. This script checks out ``--old`` (a git
revision) into a temporary worktree and runs ``roll run`` (the embedded default, the README's run
command) from each source tree in turn, alternating ``old, new, old, new, ...`` for ``--rounds``
rounds so that drift of the machine hits both alike. Each run imports roll_core from its own tree
(``PYTHONPATH``) in the same virtual environment, so only roll's code differs.

Reported per tree: the median over runs of the median ``time/step_s`` of the RL steps (the first
step, which pays for lazy initialisation, is left out), the wall-clock of the whole run, and the
held-out accuracy gain (``summary.json``), then the ratio new / old. Run nothing else CPU-heavy
beside it.

    python benchmarks/bench_step_time.py --old 5d068e9 [--rounds 2] [--steps 200] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from child_env import child_env  # PYTHONPATH with roll's code under test ahead

ROOT = Path(__file__).resolve().parents[1]


def run_once(src: Path, out: Path, steps: int, overrides: list[str]) -> dict:
    env = child_env(src)
    cmd = [sys.executable, "-m", "roll_core.cli", "run", f"output_dir={out}", f"trainer.max_steps={steps}",
           "trainer.resume=never", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run from {src} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_s = [r["time/step_s"] for r in rows if "time/step_s" in r][1:]
    summary = json.loads((out / "summary.json").read_text())
    return {"step_s": statistics.median(step_s), "wall_s": wall, "gain_pp": summary.get("accuracy_gain_pp")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("overrides", nargs="*", help="config overrides for both runs")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="roll-bench-") as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old_tree), args.old],
                       check=True, capture_output=True)
        try:
            trees = {"old": old_tree / "src", "new": ROOT / "src"}
            results: dict[str, list[dict]] = {"old": [], "new": []}
            for r in range(args.rounds):
                for name, src in trees.items():
                    res = run_once(src, Path(tmp) / f"{name}-{r}", args.steps, args.overrides)
                    results[name].append(res)
                    print(f"round {r + 1} {name}: {res['step_s']:.3f} s/step, run {res['wall_s']:.0f} s, "
                          f"gain {res['gain_pp']} pp", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_tree)], check=False)

    med = {n: statistics.median(x["step_s"] for x in res) for n, res in results.items()}
    wall = {n: statistics.median(x["wall_s"] for x in res) for n, res in results.items()}
    print("\n| tree | s/step (median) | run wall-clock (s) | gains (pp) |\n|---|---|---|---|")
    for name, label in (("old", f"old ({args.old})"), ("new", "new (working tree)")):
        gains = ", ".join(f"{x['gain_pp']:+.1f}" for x in results[name] if x["gain_pp"] is not None)
        print(f"| {label} | {med[name]:.3f} | {wall[name]:.0f} | {gains} |")
    print(f"\nnew / old seconds per step: {med['new'] / med['old']:.3f}")


if __name__ == "__main__":
    main()
