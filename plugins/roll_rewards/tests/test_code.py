"""The code reward on real cases: honest programs score 1 in every test style, wrong ones 0 or partial."""

import json

import pytest

from roll_core.rewards import RewardInput
from roll_rewards.code import CodeReward, extract_code, same_value

ADD_STDIO = {"style": "stdio", "cases": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12"},
                                          {"input": "-1 1\n", "output": "0\n"}]}
HONEST = "def add(a, b):\n    return a + b"


@pytest.fixture(scope="module")
def reward():
    return CodeReward(cpu_seconds=2, wall_seconds=6)


def score(reward, program, truth, partial=True):
    reward.partial = partial
    try:
        return reward.score(RewardInput("", f"Here is my solution:\n```python\n{program}\n```", truth))
    finally:
        reward.partial = True


def test_stdio_pass_fail_and_partial(reward):
    assert score(reward, "a, b = map(int, input().split())\nprint(a + b)", ADD_STDIO) == 1.0
    assert score(reward, "print(0)", ADD_STDIO) == 1 / 3  # only the last case
    assert score(reward, "print(0)", ADD_STDIO, partial=False) == 0.0
    assert score(reward, "a, b = map(int, input().split())\nprint(a + b)", json.dumps(ADD_STDIO)) == 1.0
    assert score(reward, "print(3)\nraise SystemExit(1)", {"style": "stdio", "cases": [ADD_STDIO["cases"][0]]}) == 0.0


def test_stdio_timeout_fails(reward):
    assert score(reward, "while True: pass", ADD_STDIO) == 0.0


def test_function_style(reward):
    truth = {"style": "function", "fn_name": "pair", "cases": [
        {"args": [1, 2], "output": [1, 2]}, {"args": [0.1, 0.2], "kwargs": {}, "output": [0.1, 0.2]},
        {"args": [3, 4], "output": [3, 4]}]}
    assert score(reward, "def pair(a, b):\n    return (a, b)", truth) == 1.0  # tuples equal lists
    assert score(reward, "def pair(a, b):\n    return [a, a]", truth) == 0.0
    assert score(reward, "def pair(a, b):\n    return [a, b] if a < 3 else None", truth) == 2 / 3
    assert score(reward, "def pair(a, b):\n    return [a, b] if a < 3 else None", truth, partial=False) == 0.0


def test_assert_style(reward):
    truth = {"style": "assert", "tests": "assert add(1, 2) == 3\nassert add(-1, 1) == 0"}
    assert score(reward, HONEST, truth) == 1.0
    assert score(reward, "def add(a, b):\n    return 0", truth) == 0.5  # right only for add(-1, 1)
    assert score(reward, "def add(a, b):\n    return a * b", truth, partial=False) == 0.0
    assert score(reward, "def add(a, b):\n    while True: pass", truth) == 0.0


def test_an_honest_program_with_a_main_guard_and_helpers_scores_one(reward):
    program = ("import sys\nfrom functools import lru_cache\n@lru_cache(None)\ndef fib(n):\n"
               "    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
               "if __name__ == '__main__':\n    print(fib(int(sys.stdin.read())))\n")
    assert score(reward, program, {"style": "assert", "tests": "assert fib(10) == 55\nassert fib(0) == 0"}) == 1.0
    assert score(reward, program, {"style": "stdio", "cases": [{"input": "10", "output": "55"}]}) == 1.0
    assert score(reward, program, {"style": "function", "fn_name": "fib", "cases": [{"args": [20], "output": 6765}]}) == 1.0


def test_pytest_style_counts_passed_tests(reward):
    truth = {"style": "pytest", "tests": (
        "from solution import add\n"
        "def test_small():\n    assert add(1, 2) == 3\n"
        "def test_negative():\n    assert add(-1, -1) == -2\n"
        "def test_strings():\n    assert add('a', 'b') == 'ab'\n")}
    assert score(reward, HONEST, truth) == 1.0
    assert score(reward, "def add(a, b):\n    return abs(a) + abs(b) if isinstance(a, int) else a + b", truth) == 2 / 3
    assert score(reward, "def add(a, b):\n    return None", truth, partial=False) == 0.0


def test_bad_ground_truth_and_options_are_errors_that_name_them(reward):
    with pytest.raises(ValueError, match="style stdio, function, assert, pytest"):
        reward.score(RewardInput("", "x", {"style": "doctest"}))
    with pytest.raises(ValueError, match="option wall_seconds must be positive"):
        CodeReward(wall_seconds=0)


def test_same_value_is_strict_about_types():
    assert same_value((1, [2.0]), [1, (2.0000000000001,)])
    assert not same_value(1, "1") and not same_value(True, 1.5) and not same_value([1], [1, 2])
    assert not same_value({"a": 1}, {"a": 1, "b": 2})


def test_extract_code_takes_the_last_fenced_block():
    assert extract_code("first\n```python\nx = 1\n```\nthen\n```\ny = 2\n```") == "y = 2\n"
    assert extract_code("print(1)") == "print(1)"
