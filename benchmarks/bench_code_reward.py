"""Programs per second of the ``code`` reward, this checkout against an earlier revision, side by side.

The earlier revision's ``roll_rewards`` package is taken from git (``--baseline``, default the last
commit before the kernel-enforced sandbox) into a temporary directory; each variant scores the same
honest programs in its own process, alternating, so both see the same machine state. Each style runs
``--programs`` programs (each one a full sandbox run: start, tests, verdict); the best of ``--repeats``
rounds is kept. Prints programs/s per style and the ratio current / baseline, and, as the floor
any sandbox pays, how many bare interpreters (``python -I -S -c pass``, no sandbox) start per second.

    python benchmarks/bench_code_reward.py [--baseline b929e01] [--programs 40] [--repeats 3]
"""

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

from child_env import child_env  # PYTHONPATH with roll's code under test ahead

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "plugins/roll_rewards/src"

PROGRAM = "def add(a, b):\n    return a + b\n"
STDIO = "a, b = map(int, input().split())\nprint(a + b)\n"
TRUTHS = {
    "stdio": (STDIO, {"style": "stdio", "cases": [{"input": "2 3\n", "output": "5\n"}]}),
    "assert": (PROGRAM, {"style": "assert", "tests": "assert add(1, 2) == 3\nassert add(-1, 1) == 0"}),
    "pytest": (PROGRAM, {"style": "pytest", "tests": "from solution import add\n"
                                                       "def test_add():\n    assert add(1, 2) == 3\n"}),
    "function": (PROGRAM, {"style": "function", "fn_name": "add",
                           "cases": [{"args": [1, 2], "output": 3}, {"args": [-1, 1], "output": 0}]}),
}

WORKER = """
import json, sys, time
from roll_core.rewards import RewardInput
from roll_rewards.code import CodeReward
style, n = sys.argv[1], int(sys.argv[2])
program, truth = json.loads(sys.argv[3])
reward = CodeReward()
sample = RewardInput("", "```python\\n" + program + "```", truth)
assert reward.score(sample) == 1.0, "an honest program must score 1"
start = time.perf_counter()
for _ in range(n):
    reward.score(sample)
print(json.dumps(n / (time.perf_counter() - start)))
"""


def extract(revision: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", revision, PACKAGE],
                             capture_output=True, check=True).stdout
    tarfile.open(fileobj=BytesIO(archive)).extractall(into)
    return into / PACKAGE


def programs_per_second(package: Path, style: str, n: int) -> float | None:
    env = child_env(package)
    out = subprocess.run([sys.executable, "-c", WORKER, style, str(n), json.dumps(TRUTHS[style])],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return None  # the style does not exist in that revision
    return json.loads(out.stdout)


def bare_interpreter_starts_per_second(n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="b929e01")
    ap.add_argument("--programs", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"baseline": extract(args.baseline, Path(tmp)), "current": ROOT / PACKAGE}
        print(f"{'style':<9} {'baseline prog/s':>16} {'current prog/s':>15} {'current/baseline':>17}")
        for style in TRUTHS:
            best = {name: None for name in variants}
            for _ in range(args.repeats):
                for name, package in variants.items():
                    value = programs_per_second(package, style, args.programs)
                    if value is not None:
                        best[name] = max(best[name] or 0.0, value)
            base, cur = best["baseline"], best["current"]
            ratio = f"{cur / base:.2f}x" if base and cur else "-"
            print(f"{style:<9} {base or float('nan'):>16.1f} {cur or float('nan'):>15.1f} {ratio:>17}", flush=True)
    floor = max(bare_interpreter_starts_per_second(args.programs) for _ in range(args.repeats))
    print(f"floor: a bare interpreter start, no sandbox: {floor:.1f}/s")


if __name__ == "__main__":
    main()
