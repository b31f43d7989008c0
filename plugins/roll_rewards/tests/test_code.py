"""The code reward on real cases: passing, failing and timing-out programs in each test style."""

import json

from roll_core.rewards import RewardInput
from roll_rewards.code import CodeReward

ADD_STDIO = {"style": "stdio", "cases": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12"},
                                          {"input": "-1 1\n", "output": "0\n"}]}


def score(program, truth, **options):
    return CodeReward(cpu_seconds=2, wall_seconds=6, **options).score(
        RewardInput("", f"Here is my solution:\n```python\n{program}\n```", truth))


def test_stdio_pass_fail_and_partial():
    assert score("a, b = map(int, input().split())\nprint(a + b)", ADD_STDIO) == 1.0
    assert score("print(0)", ADD_STDIO) == 1 / 3  # only the last case
    assert score("print(0)", ADD_STDIO, partial=False) == 0.0
    assert score("a, b = map(int, input().split())\nprint(a + b)", json.dumps(ADD_STDIO)) == 1.0  # JSON text


def test_stdio_timeout_fails():
    assert score("while True: pass", ADD_STDIO) == 0.0


def test_assert_style():
    truth = {"style": "assert", "tests": "assert add(1, 2) == 3\nassert add(-1, 1) == 0"}
    assert score("def add(a, b):\n    return a + b", truth) == 1.0
    assert score("def add(a, b):\n    return a - b", truth) == 0.0
    assert score("def add(a, b):\n    while True: pass", truth) == 0.0


def test_pytest_style_counts_passed_tests():
    truth = {"style": "pytest", "tests": (
        "from solution import add\n"
        "def test_small():\n    assert add(1, 2) == 3\n"
        "def test_negative():\n    assert add(-1, -1) == -2\n"
        "def test_strings():\n    assert add('a', 'b') == 'ab'\n")}
    assert score("def add(a, b):\n    return a + b", truth) == 1.0
    assert score("def add(a, b):\n    return abs(a) + abs(b) if isinstance(a, int) else a + b", truth) == 2 / 3
    assert score("def add(a, b):\n    return None", truth, partial=False) == 0.0
