"""FrozenLake as text, on gymnasium's implementation: maps per seed, parsing, the bad-action
penalty, the goal's reward, the contract `roll check-plugin` applies, and discovery by name."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections import deque

import pytest

from roll_envs.frozen_lake import FrozenLake, parse_action


def shortest_moves(env: FrozenLake) -> str:
    """Breadth-first search over the rendered map: the moves from P to G around the holes."""
    rows = env.render().split("|")
    n = len(rows)
    start = next((r, c) for r in range(n) for c in range(n) if rows[r][c] == "P")
    steps = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}
    queue, seen = deque([(start, "")]), {start}
    while queue:
        (r, c), path = queue.popleft()
        if rows[r][c] == "G":
            return path
        for move, (dr, dc) in steps.items():
            nr, nc = r + dr, c + dc
            if 0 <= nr < n and 0 <= nc < n and (nr, nc) not in seen and rows[nr][nc] != "O":
                seen.add((nr, nc))
                queue.append(((nr, nc), path + move))
    raise AssertionError("gymnasium's maps are solvable")


@pytest.mark.parametrize("text, move", [("R", 2), ("I go left", 0), ("down.", 1), ("u", 3), ("Up!", 3),
                                        ("", None), ("123 ?", None), ("xyz", None),
                                        ("I refuse", None), ("Rightly so", None)])
def test_actions_are_read_from_text(text, move):
    assert parse_action(text) == move


def test_each_seed_draws_its_own_map_and_the_same_seed_the_same_one():
    maps = {FrozenLake().reset(seed=s)[0] for s in range(20)}
    assert len(maps) > 10
    assert FrozenLake().reset(seed=7) == FrozenLake().reset(seed=7)
    obs, info = FrozenLake(size=4).reset(seed=7)
    assert obs.startswith("P") and len(obs.split("|")) == 4 and set(obs) <= set("P_OG|")
    assert info["success"] is False and isinstance(info["state_hash"], int)


def test_the_shortest_path_reaches_the_goal_for_reward_one():
    for seed in range(10):
        env = FrozenLake(max_steps=20)
        env.reset(seed=seed)
        moves = shortest_moves(env)
        for i, move in enumerate(moves):
            obs, reward, terminated, truncated, info = env.step(move)
            assert not truncated
            assert terminated == (i == len(moves) - 1)
        assert reward == 1.0 and info["success"] and "P" in obs and "G" not in obs


def test_a_hole_ends_the_episode_without_reward():
    env = FrozenLake(size=4)
    for seed in range(50):
        obs, _ = env.reset(seed=seed)
        rows = obs.split("|")
        if rows[0][1] == "O":  # a hole right of the start
            _, reward, terminated, _, info = env.step("R")
            assert terminated and reward == 0.0 and not info["success"]
            return
    pytest.skip("no map with a hole next to the start in 50 seeds")


def test_a_bad_action_costs_the_penalty_and_leaves_the_agent_in_place():
    env = FrozenLake(invalid_action_penalty=-0.25, max_steps=2)
    obs, info = env.reset(seed=0)
    after, reward, terminated, truncated, new_info = env.step("I refuse")
    assert (after, reward, terminated, truncated) == (obs, -0.25, False, False)
    assert new_info["invalid_action"] and new_info["state_hash"] == info["state_hash"]
    assert env.step("???")[3]  # the second step reaches max_steps: truncated


def test_moving_changes_the_state_hash():
    env = FrozenLake()
    _, info = env.reset(seed=0)
    moves = shortest_moves(env)
    _, _, _, _, moved = env.step(moves[0])
    assert moved["state_hash"] != info["state_hash"]


@pytest.mark.parametrize("options, message", [({"size": 1}, "size must be at least 2"),
                                              ({"frozen_fraction": 0}, "frozen_fraction must be in"),
                                              ({"max_steps": 0}, "max_steps must be at least 1")])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        FrozenLake(**options)


def roll(*args, env=None):
    return subprocess.run([sys.executable, "-m", "roll_core.cli", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_listed_by_name_and_passes_check_plugin():
    out = roll("list-plugins", "--json")
    assert out.returncode == 0, out.stderr
    mine = {p["name"]: p for p in json.loads(out.stdout)["plugins"]}["envs"]
    assert mine["distribution"] == "roll-envs" and mine["status"] == "ok"
    assert mine["provides"] == {"envs": ["frozen_lake", "gymnasium", "sokoban", "tool_use"]}
    out = roll("check-plugin", "envs")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("determinism under a seed") == 4 and "8 passed" in out.stdout


def test_listing_does_not_import_gymnasium():
    from roll_core.testing import assert_registered_lazily

    assert_registered_lazily("envs", "frozen_lake", "gymnasium")


def play(capsys, monkeypatch, *args) -> subprocess.CompletedProcess:
    """``roll play frozen_lake ARGS`` in this process (``roll`` above runs the command's entry point
    in a child; each child imports torch again, about ten seconds). The variables the command sets
    for itself are set here first, so that they end with the test."""
    from roll_core.cli import main

    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    capsys.readouterr()
    code = main(["play", "frozen_lake", *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_roll_play_prints_one_episode_turn_by_turn(tmp_path, capsys, monkeypatch):
    out = roll("play", "frozen_lake", "--policy", "scripted", "--actions", "R,R,D", "--seed", "0")
    assert out.returncode == 0, out.stderr
    assert "[turn 0] P___|OO__|_OO_|O__G>" in out.stdout and "[turn 2] __P_|OO__|_OO_|O__G>" in out.stdout
    # the last action repeats: down into the hole below, and the environment ends the episode
    assert out.stdout.strip().endswith("return 0, 4 turns, success False, ended by the environment")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = play(capsys, monkeypatch, "--policy", "model", "--max-turns", "2", "--seed", "1")  # the untrained tiny model
    assert out.returncode == 0, out.stderr
    assert "[turn 1]" in out.stdout and "2 turns" in out.stdout
    # the tiny model it built is gone (torch's compile cache, torchinductor_<user>, is torch's to keep)
    assert [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor")] == []
    out = play(capsys, monkeypatch, "--policy", "random")
    assert out.returncode == 2 and "--policy random needs --actions" in out.stderr


def test_roll_play_shows_pictures_to_the_embedded_image_text_model(capsys, monkeypatch):
    """With ``observation: image`` and no ``--model``, ``roll play`` builds the embedded model's
    image-text variant, which reads the pictures; each shows in the transcript as ``<image>``."""
    options = ("--options", "{observation: image, view_radius: 1}", "--max-turns", "2", "--seed", "1")
    out = play(capsys, monkeypatch, *options, "--policy", "model")
    assert out.returncode == 0, out.stderr
    assert "[turn 0] <image>>" in out.stdout and "[turn 1] <image>>" in out.stdout and "2 turns" in out.stdout


def test_roll_play_samples_with_the_rollouts_cuts_checked_as_its_keys_are(capsys, monkeypatch):
    model = ("--policy", "model", "--max-turns", "2", "--seed", "3")
    greedy = play(capsys, monkeypatch, *model, "--temperature", "0")
    top_one = play(capsys, monkeypatch, *model, "--top-k", "1")  # at temperature 1: the most likely token, as greedy
    assert greedy.returncode == top_one.returncode == 0, greedy.stderr + top_one.stderr
    assert top_one.stdout == greedy.stdout
    out = play(capsys, monkeypatch, *model, "--top-p", "0")
    assert out.returncode == 2 and "rollout.top_p" in out.stderr and "greater than 0" in out.stderr


@pytest.mark.parametrize("seed", range(20))
def test_the_expert_walks_a_shortest_safe_path_to_the_goal(seed):
    env = FrozenLake(size=4, max_steps=20)
    env.reset(seed=seed)
    length = len(shortest_moves(env))
    for moves in range(1, 20):
        _, reward, terminated, _, info = env.step(env.expert_action())
        if terminated:
            break
    assert info["success"] and reward == 1.0 and moves == length
    assert env.expert_action() is None  # on the goal: nothing left to do


def test_show_neighbors_appends_the_four_tiles_around_the_agent():
    env = FrozenLake(size=4, show_neighbors=True)
    obs, _ = env.reset(seed=0)
    grid, around = obs.split(":")
    assert grid == FrozenLake(size=4).reset(seed=0)[0]
    rows = grid.split("|")
    assert around == "#" + rows[1][0] + rows[0][1] + "#"  # left, down, right, up of the start (0, 0)


def test_the_careless_teacher_makes_mistakes_in_proportion_to_its_noise(tiny_model_path):
    from roll_core.agentic.episodes import play, teacher_policy
    from roll_core.pipelines.runtime import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_path))
    rates = []
    for noise in (0.0, 0.3, 1.0):
        episodes = play([FrozenLake(max_steps=8) for _ in range(100)], list(range(100)), list(range(100)),
                        teacher_policy(tokenizer, noise=noise, seed=1), tokenizer, max_turns=8)
        rates.append(sum(e.info["success"] for e in episodes) / 100)
    assert rates[0] == 1.0 and 0.3 < rates[1] < 0.8 and rates[2] < 0.1
