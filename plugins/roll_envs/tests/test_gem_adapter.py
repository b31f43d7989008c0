"""GEM's environments through roll's Env interface, found by name (needs ``roll-envs[gem]``)."""

from __future__ import annotations

import pytest

pytest.importorskip("gem")


def test_every_gem_environment_is_registered_by_name(roll_plugins):
    from roll_envs.gem_adapter import gem_ids

    plugins = roll_plugins()
    names = set(plugins.envs.names())
    assert {f"gem:{i}" for i in gem_ids()} <= names and "gem:game:GuessTheNumber-v0-easy" in names
    assert plugins.envs.entry("gem:rg:maze").plugin == "gem"


def test_a_gem_game_plays_through_the_adapter_deterministically(roll_plugins):
    cls = roll_plugins().envs.get("gem:game:GuessTheNumber-v0-easy")
    traces = []
    for _ in range(2):
        env = cls()
        obs, info = env.reset(seed=7)
        assert "Guess The Number" in obs and isinstance(info["state_hash"], int) and not info["success"]
        trace = [obs]
        for guess in range(1, 11):  # 4 turns at most: the episode ends one way or the other
            obs, reward, terminated, truncated, info = env.step(f"\\boxed{{{guess}}}")
            trace.append((obs, reward, terminated, truncated, info["success"]))
            assert isinstance(info["state_hash"], int)
            if terminated or truncated:
                break
        env.close()
        traces.append(trace)
    assert traces[0] == traces[1]
    assert traces[0][-1][2] or traces[0][-1][3]


def test_the_adapter_says_success_only_for_a_rewarded_ending(roll_plugins):
    env = roll_plugins().envs.get("gem:game:GuessTheNumber-v0-easy")(min_number=1, max_number=2, max_turns=2)
    env.reset(seed=0)
    outcomes = [env.step("\\boxed{1}")]
    if not (outcomes[0][2] or outcomes[0][3]):
        outcomes.append(env.step("\\boxed{2}"))
    obs, reward, terminated, truncated, info = outcomes[-1]
    assert terminated and reward == 1.0 and info["success"]  # one of 1, 2 is right, and the hint leads there


def test_partial_credit_at_the_last_turn_is_not_success(roll_plugins):
    env = roll_plugins().envs.get("gem:game:GuessTheNumber-v0-easy")(min_number=1, max_number=10, max_turns=1)
    env.reset(seed=7)
    guess = next(g for g in range(1, 11) if g != env._env.game_number)
    obs, reward, terminated, truncated, info = env.step(f"\\boxed{{{guess}}}")
    assert 0 < reward < 1 and not info["success"]  # closeness credit, not the goal
