"""The tool-use environment: the calculator, sandboxed Python (roll-rewards' sandbox), answers,
penalties, the expert, and options."""

from __future__ import annotations

import pytest

from roll_envs.tool_use import ToolUse, calculate


def test_the_calculator_does_arithmetic_and_nothing_else():
    assert calculate("(37 * 48) + 19") == 1795 and calculate("-2 ** 3") == -8 and calculate("7 // 2 % 3") == 0
    for bad in ("__import__('os')", "x + 1", "2 ** 1000", "1 / 0", "[1, 2]", "print(1)"):
        with pytest.raises(ValueError):
            calculate(bad)


def test_an_episode_with_the_calculator_then_a_correct_answer():
    env = ToolUse(tools=["calculator"])
    obs, info = env.reset(seed=1)
    assert obs.startswith("What is (28 * 83) + 99?") and "'calc: ...'" in obs and "python" not in obs
    assert env.step("calc: 28 * 83 + 99") == ("= 2423", 0.0, False, False, env._info(False, tool_calls=1))
    obs, reward, terminated, truncated, info = env.step("answer: 2423")
    assert (obs, reward, terminated, info["success"]) == ("correct", 1.0, True, True)


def test_wrong_answers_bad_replies_and_unavailable_tools():
    env = ToolUse(tools=["calculator"], max_steps=3, invalid_action_penalty=-0.5)
    env.reset(seed=1)
    obs, reward, terminated, truncated, _ = env.step("python: print(1)")  # not an available tool
    assert obs.startswith("error: no tool or answer") and reward == -0.5 and not terminated
    assert env.step("calc: import os")[1] == -0.5
    assert env.step("answer: 1")[:4] == ("wrong", 0.0, True, False)


def test_the_expert_calculates_then_answers():
    env = ToolUse(tools=["calculator"])
    for seed in range(10):
        env.reset(seed=seed)
        assert env.step(env.expert_action())[0].startswith("= ")
        assert env.step(env.expert_action())[4]["success"]


def test_options_are_checked():
    with pytest.raises(ValueError, match="tools must name"):
        ToolUse(tools=["shell"])


def test_python_runs_in_the_code_reward_sandbox():
    pytest.importorskip("roll_rewards")
    env = ToolUse(tools=["python"], python_wall_seconds=3)
    env.reset(seed=1)
    obs, reward, *_ = env.step("python: print(28 * 83 + 99)")
    assert (obs, reward) == ("output: 2423", 0.0)
    probe = ("python: import os, socket\n"
             "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=1); net = 'reached'\n"
             "except OSError:\n    net = 'no network'\n"
             "print(os.getuid() != 0, net)")
    assert env.step(probe)[0] == "output: True no network"  # a non-root user, no network: the sandbox's rules
    obs, reward, *_ = env.step("python: while True: pass")
    assert obs.startswith("error: python") and reward == -0.1  # the time limit stops it
