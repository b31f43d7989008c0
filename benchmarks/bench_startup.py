"""How long a process that never compiles takes to start, with and without TorchDynamo imported.

``torch.compiler.disable`` imports TorchDynamo when it decorates a function. Until ef83dae two of
roll's functions were decorated at import (oneDNN's linear layer and packed attention, which
compiled layers call as they are), so every process that imported the strategies paid for it:
``roll validate``, reward and environment workers, a Ray run's driver. Now
``strategies.compiled.OutsideCompiledCode`` marks them and the first compile disables them. (A
process that builds a transformers model imports TorchDynamo anyway: transformers' masking code
does.)

This script times, in fresh processes, alternating for ``--rounds`` rounds:

* ``lazy``: the command as roll runs it now;
* ``eager``: the same, after ``import torch._dynamo`` (what the decorators cost before).

The commands: ``workers`` imports the strategies and the workers, as a reward worker does;
``validate`` is ``roll validate`` on the quickstart's config. It prints the medians of the wall
times and their ratio.

    python benchmarks/bench_startup.py [--rounds 5] [--commands workers validate]

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

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {
    "workers": ("import the strategies and workers", "import roll_core.runtime.workers, roll_core.strategies.hf"),
    "validate": ("roll validate", "import sys; from roll_core import cli; "
                                  f"sys.exit(cli.main(['validate', {str(ROOT / 'examples' / 'quickstart.yaml')!r}]))"),
}
# Each child says at exit whether TorchDynamo was imported, so a row cannot time what it does not say.
REPORT = "import atexit, sys\natexit.register(lambda: print('dynamo', 'torch._dynamo' in sys.modules))\n"


def one(way: str, code: str) -> float:
    """The wall seconds of one fresh process running ``code`` the ``way`` named."""
    if way == "eager":
        code = "import torch._dynamo; " + code
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", REPORT + code],
                         capture_output=True, text=True, cwd=ROOT, env=child_env(ROOT / "src"))
    elapsed = time.monotonic() - start
    if out.returncode != 0:
        sys.exit(f"{way}: {code} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    if f"dynamo {way == 'eager'}" not in out.stdout:
        sys.exit(f"{way}: {code} imported TorchDynamo {'never' if way == 'eager' else 'anyway'}:\n{out.stdout}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--commands", nargs="+", choices=list(COMMANDS), default=list(COMMANDS))
    args = parser.parse_args()
    times: dict[tuple[str, str], list[float]] = {(name, way): [] for name in args.commands for way in ("lazy", "eager")}
    for r in range(args.rounds):
        for name in args.commands:
            for way in ("eager", "lazy"):
                times[name, way].append(one(way, COMMANDS[name][1]))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(f"\nmedians of {args.rounds} rounds, each in a fresh process")
    print(f"{'command':36s} {'eager':>8s} {'lazy':>8s} {'ratio':>7s}")
    for name in args.commands:
        eager, lazy = (statistics.median(times[name, way]) for way in ("eager", "lazy"))
        print(f"{COMMANDS[name][0]:36s} {eager:7.2f}s {lazy:7.2f}s {eager / lazy:6.2f}x")


if __name__ == "__main__":
    main()
