"""Tests of the example plugin, written with the fixtures roll-core gives plugin authors
(``roll_plugins``, ``tiny_config``; registered through pytest's ``pytest11`` entry point)."""

import json
from pathlib import Path

import pytest

from roll_core.rewards import RewardInput
from roll_numeric_reward.reward import NumericCloseness


@pytest.mark.parametrize("response, truth, scale, expected", [
    ("085", "085", 1.0, 1.0),
    ("084", "085", 1.0, 0.5),
    ("075", "085", 10.0, 0.5),
    ("the answer is 85", "085", 1.0, 1.0),
    ("-3", "1", 2.0, 1 / 3),
    ("", "085", 1.0, 0.0),
])
def test_scores(response, truth, scale, expected):
    assert NumericCloseness(scale=scale).score(RewardInput("p", response, truth)) == pytest.approx(expected)


def test_bad_scale_is_refused():
    with pytest.raises(ValueError, match="scale must be > 0"):
        NumericCloseness(scale=0)


def test_registered_through_the_installed_entry_point(roll_plugins):
    plugins = roll_plugins()
    assert plugins.rewards.entry("numeric_closeness").plugin == "numeric"
    assert plugins.plugins["numeric"].distribution == "roll-numeric-reward"


def test_contract_checks_pass(roll_plugins):
    from roll_core.contracts import check_plugin

    report = check_plugin("numeric", roll_plugins())
    assert report.ok, report.failures()


def test_used_by_name_in_a_run(tiny_config):
    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.runtime import make_executor

    cfg = tiny_config("roles.reward.name=numeric_closeness", "roles.reward.options.scale=10", "trainer.max_steps=2")
    RLVRPipeline(cfg, make_executor(cfg)).run()
    steps = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    rewards = [s["reward/mean"] for s in steps if "reward/mean" in s]
    # Dense partial credit: strictly between 0 and 1 for a barely warmed-up model.
    assert len(rewards) == 2 and all(0.0 < r < 1.0 for r in rewards)
