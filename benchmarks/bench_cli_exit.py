"""How long a `roll` command takes to exit, with and without the collector's work frozen.

A process that imported torch and transformers holds hundreds of thousands of objects, and the
interpreter's own garbage collections at exit walk them all. ``roll_core.cli.console`` (the `roll`
command) runs one collection itself when the command is done, then ``gc.freeze()``, which leaves
every object alive at that point out of the collections at exit. This script runs each command
both ways, in fresh processes, alternating for ``--rounds`` rounds:

* ``main`` is ``sys.exit(roll_core.cli.main(argv))``, the command as it was;
* ``console`` is ``roll_core.cli.console()``, the command as the `roll` script runs it now.

Each child prints the moment its command returned; this script takes the time from then to the
child's end (its exit) and its whole wall time, and prints their medians and the ratios. The
commands: ``roll validate`` on the quickstart's config, and a two-step ``roll run`` of the embedded
default on the local executor (warm-up 2 steps, no evaluation).

    python benchmarks/bench_cli_exit.py [--rounds 5] [--commands validate run]

Run nothing else CPU-heavy beside it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from child_env import child_env  # this checkout's src/ ahead on PYTHONPATH
from scratch import scratch_dir  # a temporary directory, removed at exit

ROOT = Path(__file__).resolve().parent.parent
# The child: runs the command through `main` alone or through `console` itself, printing the moment
# the command returned (console calls the module's `main`, replaced by the timed one).
CHILD = """
import sys, time
from roll_core import cli
command = cli.main
def timed():
    code = command(sys.argv[2:])
    print("returned-at", time.monotonic(), flush=True)
    return code
if sys.argv[1] == "console":
    cli.main = timed
    cli.console()
sys.exit(timed())
"""


def commands(run_dir: str) -> dict[str, tuple[str, list[str]]]:
    """``--commands`` name -> (the row's label, the command's arguments)."""
    return {
        "validate": ("roll validate", ["validate", str(ROOT / "examples" / "quickstart.yaml")]),
        "run": ("roll run, 2 local steps", ["run", f"output_dir={run_dir}", "executor=local", "trainer.max_steps=2",
                                            "warmup.steps=2", "data.eval_size=8", "trainer.eval_every=0",
                                            "trainer.resume=never"]),
    }


def one(variant: str, argv: list[str]) -> tuple[float, float]:
    """(seconds from the command's return to the process's end, the process's wall seconds)."""
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", CHILD, variant, *argv], capture_output=True, text=True, cwd=ROOT,
                         env=child_env(ROOT / "src"))
    end = time.monotonic()
    if out.returncode != 0:
        sys.exit(f"{variant} {' '.join(argv)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    returned = float(next(line for line in out.stdout.splitlines() if line.startswith("returned-at")).split()[1])
    return end - returned, end - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--commands", nargs="+", choices=["validate", "run"], default=["validate", "run"])
    args = parser.parse_args()
    every = commands(scratch_dir("roll-cli-exit-"))
    table = dict(every[name] for name in args.commands)
    times: dict[tuple[str, str], list[tuple[float, float]]] = {(name, v): [] for name in table
                                                               for v in ("main", "console")}
    for r in range(args.rounds):
        for name, argv in table.items():
            for variant in ("main", "console"):
                times[name, variant].append(one(variant, argv))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(f"\nmedians of {args.rounds} rounds, each command in a fresh process")
    print(f"{'command':26s} {'exit, main':>11s} {'exit, console':>14s} {'wall, main':>11s} {'wall, console':>14s} "
          f"{'wall ratio':>11s}")
    for name in table:
        m_exit, m_wall = (statistics.median(x) for x in zip(*times[name, "main"]))
        c_exit, c_wall = (statistics.median(x) for x in zip(*times[name, "console"]))
        print(f"{name:26s} {m_exit:10.3f}s {c_exit:13.3f}s {m_wall:10.2f}s {c_wall:13.2f}s {m_wall / c_wall:10.2f}x")


if __name__ == "__main__":
    main()
