"""``code``: run a model-written Python program against hidden tests, in a kernel-enforced sandbox.

The program is the last fenced code block of the response (or the whole response when it has no
fence). ``ground_truth`` (a dict, or its JSON text) says how to test it:

* ``{"style": "stdio", "cases": [{"input": "1 2\\n", "output": "3\\n"}, ...]}``: one run per case;
  the program's stdout, compared after stripping trailing whitespace on each line, and exit 0;
* ``{"style": "function", "fn_name": "add", "cases": [{"args": [1, 2], "kwargs": {}, "output": 3}]}``
  (APPS-style call-based tests): the function is called once per case; its result, returned as plain
  data, is compared here (tuples equal lists, floats to within 1e-9 relative);
* ``{"style": "assert", "tests": "assert add(1, 2) == 3\\n..."}``: each top-level ``assert`` is one
  test; other statements (imports, helpers) run in order;
* ``{"style": "pytest", "tests": "from solution import add\\ndef test_add(): ..."}``: each pytest
  test is one test, its outcome taken from pytest's reports.

How the verdict is made (the reward is built to be attacked by the policy it trains):

* tests and expected values never enter the sandbox. Assert and pytest tests run in a separate
  trusted process; the program's functions are proxies there, which send arguments in and get
  results back as plain data (no objects, classes or generators cross, and in-place changes to
  arguments are not seen: write such tests in stdio or function style);
* a test passes only when its result arrived and matched. Exiting early, crashing, printing
  "5 passed", rigging ``__eq__`` or patching the test framework cannot pass a test;
* a program that times out, exhausts a limit or breaks a sandbox rule fails what it has not answered.

Score: the fraction of passed tests (``partial=True``, the default) or 1/0 for all-or-nothing.

Options: ``partial``, ``cpu_seconds``, ``wall_seconds`` (one deadline per program run, covering all
of a function- or assert-style run's tests), ``memory_mb``, ``max_processes``, ``disk_mb``,
``isolation`` (``bubblewrap``, or ``unsafe`` for trusted local experiments only, warned on every
run) and ``python`` (the interpreter programs run with; by default the worker's own when the
sandbox user can reach it, else the system's ``python3``). Needs ``bwrap`` (Debian: ``apt-get
install bubblewrap``); without it the reward refuses to start and says so.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from roll_core.rewards import Reward, RewardInput
from roll_rewards.sandbox import ProgramError, Sandbox, SandboxLimits

FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
STYLES = ("stdio", "function", "assert", "pytest")


def extract_code(response: str) -> str:
    """The last fenced code block of ``response``, or the whole response when there is none."""
    blocks = FENCE.findall(response)
    return blocks[-1] if blocks else response


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def same_value(got: Any, expected: Any) -> bool:
    """Plain-data equality for function results: tuples equal lists, floats within 1e-9 relative."""
    if isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(got) == len(expected) and all(same_value(g, e) for g, e in zip(got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(same_value(got[k], expected[k]) for k in got)
    if type(got) is float or type(expected) is float:
        if type(got) not in (int, float) or type(expected) not in (int, float):
            return False
        return math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(got) and math.isnan(expected))
    return type(got) is type(expected) and got == expected


class CodeReward(Reward):
    """See the module docstring for test styles and options."""

    def __init__(self, partial: bool = True, cpu_seconds: int = 5, wall_seconds: float = 10.0,
                 memory_mb: int = 512, max_processes: int = 16, disk_mb: int = 64,
                 isolation: str = "bubblewrap", python: str | None = None):
        for name, value in (("cpu_seconds", cpu_seconds), ("wall_seconds", wall_seconds), ("memory_mb", memory_mb),
                            ("max_processes", max_processes), ("disk_mb", disk_mb)):
            if not value > 0:
                raise ValueError(f"code reward: option {name} must be positive, got {value!r}")
        self.partial = partial
        self.sandbox = Sandbox(SandboxLimits(cpu_seconds=cpu_seconds, wall_seconds=wall_seconds, memory_mb=memory_mb,
                                             max_processes=max_processes, disk_mb=disk_mb),
                               isolation=isolation, python=python)

    def spec(self, ground_truth: Any) -> dict:
        spec = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
        if not isinstance(spec, dict) or spec.get("style") not in STYLES:
            raise ValueError(f"code reward: ground_truth must be a dict with style {', '.join(STYLES)}; "
                             f"got {str(ground_truth)[:80]!r}")
        return spec

    @classmethod
    def contract_examples(cls):
        tests = {"style": "assert", "tests": "assert add(2, 3) == 5"}
        return [({}, RewardInput("Write add.", "```python\ndef add(a, b):\n    return a + b\n```", tests), 1.0),
                ({}, RewardInput("Write add.", "def add(a, b): return a - b", tests), 0.0)]

    def score(self, sample: RewardInput) -> float:
        passed, total = self.run_tests(extract_code(sample.response), self.spec(sample.ground_truth))
        if total == 0:
            return 0.0
        return passed / total if self.partial else float(passed == total)

    def run_tests(self, program: str, spec: dict) -> tuple[int, int]:
        """(passed, total) for ``program`` against the tests in ``spec``."""
        style = spec["style"]
        if style == "stdio":
            return self._stdio(program, spec["cases"])
        if style == "function":
            return self._function(program, spec["fn_name"], spec["cases"])
        return self.sandbox.run_tests(program, spec["tests"], style)

    def _stdio(self, program: str, cases: list[dict]) -> tuple[int, int]:
        passed = 0
        for case in cases:
            result = self.sandbox.run_script(program, stdin=case.get("input", ""))
            ok = result.ok and _lines(result.stdout) == _lines(case["output"])
            if not ok and not self.partial:
                break  # all-or-nothing: the first failure decides
            passed += ok
        return passed, len(cases)

    def _function(self, program: str, name: str, cases: list[dict]) -> tuple[int, int]:
        passed = 0
        with self.sandbox.serve(program) as served:
            for case in cases:
                try:
                    passed += same_value(served.call(name, case.get("args", []), case.get("kwargs")),
                                         case["output"])
                except ProgramError as e:
                    if e.kind in ("timeout", "exited", "protocol"):
                        break  # nothing further can arrive
        return passed, len(cases)
