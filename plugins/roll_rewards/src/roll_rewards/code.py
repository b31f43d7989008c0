"""``code``: run a model-written Python program against test cases, inside the sandbox.

The program is the last fenced code block of the response (or the whole response when it has no
fence). ``ground_truth`` (a dict, or its JSON text) says how to test it:

* ``{"style": "stdio", "cases": [{"input": "1 2\\n", "output": "3\\n"}, ...]}``: one run per case,
  stdin in, stdout compared after stripping trailing whitespace on each line;
* ``{"style": "assert", "tests": "assert add(1, 2) == 3\\n..."}``: the tests appended to the
  program, one run, passes when it exits 0;
* ``{"style": "pytest", "tests": "from solution import add\\ndef test_add(): ..."}``: the program
  saved as ``solution.py``, the tests as ``test_solution.py``, pytest run on both.

Score: the fraction of passed cases (``partial=True``, the default) or 1/0 for all-or-nothing.
A program that times out, exhausts memory, floods its output or breaks a sandbox rule fails.
"""

from __future__ import annotations

import json
import re
from typing import Any

from roll_core.rewards import Reward, RewardInput
from roll_rewards.sandbox import SandboxLimits, run_python, run_sandboxed

FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The last fenced code block of ``response``, or the whole response when there is none."""
    blocks = FENCE.findall(response)
    return blocks[-1] if blocks else response


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


class CodeReward(Reward):
    """Options: ``partial`` (default True), ``cpu_seconds``, ``wall_seconds``, ``memory_mb``."""

    def __init__(self, partial: bool = True, cpu_seconds: int = 5, wall_seconds: float = 10.0,
                 memory_mb: int = 512):
        self.partial = partial
        self.limits = SandboxLimits(cpu_seconds=cpu_seconds, wall_seconds=wall_seconds, memory_mb=memory_mb)

    def spec(self, ground_truth: Any) -> dict:
        spec = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
        if not isinstance(spec, dict) or spec.get("style") not in ("stdio", "assert", "pytest"):
            raise ValueError("code reward: ground_truth must be a dict with style stdio, assert or pytest, "
                             f"got {str(ground_truth)[:80]!r}")
        return spec

    @classmethod
    def contract_examples(cls):
        tests = {"style": "assert", "tests": "assert add(2, 3) == 5"}
        return [({}, RewardInput("Write add.", "```python\ndef add(a, b):\n    return a + b\n```", tests), 1.0),
                ({}, RewardInput("Write add.", "def add(a, b): return a - b", tests), 0.0)]

    def score(self, sample: RewardInput) -> float:
        spec = self.spec(sample.ground_truth)
        code = extract_code(sample.response)
        if spec["style"] == "stdio":
            cases = spec["cases"]
            passed = 0
            for case in cases:
                result = run_python(code, stdin=case.get("input", ""), limits=self.limits)
                ok = result.ok and _lines(result.stdout) == _lines(case["output"])
                if not ok and not self.partial:
                    return 0.0  # all-or-nothing: the first failure decides
                passed += ok
            return passed / len(cases)
        if spec["style"] == "assert":
            return float(run_python(code + "\n\n" + spec["tests"], limits=self.limits).ok)
        result = run_sandboxed({"solution.py": code, "test_solution.py": spec["tests"]}, mode="pytest",
                               limits=self.limits)
        if result.ok:
            return 1.0
        if not self.partial:
            return 0.0
        counts = dict((k, int(v)) for v, k in re.findall(r"(\d+) (passed|failed|error)", result.stdout))
        total = sum(counts.values())
        return counts.get("passed", 0) / total if total else 0.0
