"""Sokoban as text: rooms per seed are solvable, pushes and rewards follow the rules, the expert
solves every room, bad replies cost the penalty."""

from __future__ import annotations

import pytest

from roll_envs.sokoban import Sokoban


def test_a_room_is_drawn_with_its_characters_and_replays_under_its_seed():
    obs, info = Sokoban().reset(seed=1)
    assert obs == Sokoban().reset(seed=1)[0] != Sokoban().reset(seed=2)[0]
    rows = obs.split("|")
    assert len(rows) == 6 and set(rows[0]) == {"#"} and obs.count("$") == 1 and obs.count(".") == 1
    assert sum(obs.count(ch) for ch in "@+") == 1 and not info["success"]


@pytest.mark.parametrize("boxes", [1, 2])
def test_the_expert_solves_every_room_and_earns_the_documented_rewards(boxes):
    for seed in range(25):
        env = Sokoban(num_boxes=boxes, max_steps=50)
        env.reset(seed=seed)
        total, shortest = 0.0, env._solution_length()
        for moves in range(1, 51):
            _, reward, terminated, truncated, info = env.step(env.expert_action())
            total += reward
            if terminated:
                break
        assert info["success"] and moves == shortest
        # -0.1 a step, +10 at the end, and the pushes on and off targets net +1 per box
        assert total == pytest.approx(-0.1 * moves + 10 + boxes - _on_target_at_start(seed, boxes))


def _on_target_at_start(seed, boxes):
    env = Sokoban(num_boxes=boxes)
    env.reset(seed=seed)
    return len(env.boxes & env.targets)


def test_walls_and_boxes_stop_moves_and_a_push_moves_the_box():
    env = Sokoban()
    env.reset(seed=0)
    env.walls, env.targets = {(r, c) for r in range(6) for c in range(6) if r in (0, 5) or c in (0, 5)}, frozenset({(2, 4)})
    env.player, env.boxes = (2, 2), frozenset({(2, 3)})
    obs, reward, terminated, _, info = env.step("right")  # pushes the box onto its target
    assert env.boxes == frozenset({(2, 4)}) and env.player == (2, 3)
    assert reward == pytest.approx(-0.1 + 1 + 10) and terminated and info["success"]
    env.boxes, env.player, env.targets = frozenset({(2, 4)}), (2, 3), frozenset({(1, 1)})
    before = env.render()
    obs, reward, *_ = env.step("R")  # the box is against the wall: nothing moves
    assert obs == before and reward == pytest.approx(-0.1)
    obs, reward, *_ = env.step("R")
    assert reward == pytest.approx(-0.1)


def test_a_reply_without_a_move_costs_the_penalty():
    env = Sokoban(max_steps=1, invalid_action_penalty=-0.5)
    obs, _ = env.reset(seed=4)
    assert env.step("I refuse") == (obs, pytest.approx(-0.6), False, True, env._info(invalid=True))


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="size must be at least 4"):
        Sokoban(size=3)
    with pytest.raises(ValueError, match="num_boxes must be in"):
        Sokoban(num_boxes=50)
