"""gymnasium environments as text: rendering, action parsing, the penalty, success, determinism."""

from __future__ import annotations

import pytest

from roll_envs.gymnasium_text import GymnasiumText


def cliff(**options):
    return GymnasiumText(id="CliffWalking-v1", action_names=["up", "right", "down", "left"], **options)


def test_the_ansi_rendering_is_the_observation_and_named_moves_step_the_environment():
    env = cliff()
    obs, info = env.reset(seed=0)
    assert obs.splitlines()[-1].split() == ["x"] + ["C"] * 10 + ["T"] and "\x1b" not in obs
    obs, reward, terminated, truncated, info = env.step("I go UP")
    assert obs.splitlines()[2].split()[0] == "x" and reward == -1.0 and not (terminated or truncated)
    assert env.step("then 1")[0].splitlines()[2].split()[:2] == ["o", "x"]  # an index works too


def test_a_reply_without_an_action_costs_the_penalty_and_counts_toward_max_steps():
    env = cliff(max_steps=2, invalid_action_penalty=-0.5)
    obs, _ = env.reset(seed=0)
    assert env.step("hmm")[:4] == (obs, -0.5, False, False)
    assert env.step("7 is too big")[1:4] == (-0.5, False, True)


def test_success_needs_the_success_reward_at_termination():
    env = GymnasiumText(id="FrozenLake-v1", is_slippery=False, action_names=["left", "down", "right", "up"])
    env.reset(seed=0)
    for move in ["right", "right", "down", "down", "down", "right"]:
        obs, reward, terminated, truncated, info = env.step(move)
    assert terminated and reward == 1.0 and info["success"] and isinstance(info["state_hash"], int)
    env.reset(seed=0)
    env.step("down")
    obs, reward, terminated, truncated, info = env.step("right")  # into the hole at (1, 1)
    assert terminated and not info["success"]


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="has 4 actions, action_names names 2"):
        GymnasiumText(id="CliffWalking-v1", action_names=["up", "down"])
    with pytest.raises(ValueError, match="only Discrete"):
        GymnasiumText(id="MountainCarContinuous-v0")


def test_an_episode_replays_identically_under_its_seed():
    traces = []
    for _ in range(2):
        env = cliff()
        trace = [env.reset(seed=3)[0]] + [env.step(a)[:2] for a in ["up", "right", "right", "down"]]
        traces.append(trace)
    assert traces[0] == traces[1]
