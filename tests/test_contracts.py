"""``roll check-plugin``: every built-in passes its contract checks, and the usual plugin bugs fail
them with a message that says what is wrong."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from roll_core.contracts import check_plugin
from roll_core.errors import PluginError
from roll_core.rewards import Reward, RewardInput
from roll_core.testing import hooks


@pytest.mark.parametrize("name", ["roll-core", "rewards"])
def test_builtin_plugins_pass(name, roll_plugins):
    if name == "rewards":
        pytest.importorskip("roll_rewards")
    report = check_plugin(name, roll_plugins())
    assert report.ok, report.failures()
    assert sum(r.status == "ok" for r in report.results) >= 10


class ReturnsText(Reward):
    def score(self, sample):
        return "1.0"


class WrongExample(Reward):
    def score(self, sample):
        return 0.0

    @classmethod
    def contract_examples(cls):
        return [({}, RewardInput("q", "a", "a"), 1.0)]


class NeedsOptions(Reward):
    def __init__(self, path: str):
        self.path = path

    def score(self, sample):
        return 0.0


class TakesTwo(Reward):
    def score(self, sample, extra):
        return 0.0


class ClosesBadly(Reward):
    def score(self, sample):
        return 1.0

    def close(self):
        raise RuntimeError("the judge's connection was already gone")


def per_sequence_estimator(batch, config):
    scores = batch.token_level_rewards.sum(-1)
    return scores, scores  # [B], not [B, R]


def scalar_loss(inputs, config):
    return (inputs.log_prob * inputs.advantages).mean(), {}


def _buggy_plugin():
    def rewards(register):
        for cls in (ReturnsText, WrongExample, NeedsOptions, TakesTwo, ClosesBadly):
            register(cls.__name__.lower(), cls)

    return hooks(
        roll_register_rewards=rewards,
        roll_register_advantage_estimators=lambda register: register("per_seq", per_sequence_estimator),
        roll_register_policy_losses=lambda register: register("scalar", scalar_loss),
    )


def test_common_plugin_bugs_fail_with_what_is_wrong(roll_plugins):
    report = check_plugin("buggy", roll_plugins(("buggy", _buggy_plugin())))
    assert not report.ok
    failed = {r.component: r.detail for r in report.results if r.status == "failed"}
    assert "must be a number, got str '1.0'" in failed["rewards:returnstext"]
    assert "= 0.0, expected 1.0" in failed["rewards:wrongexample"]
    assert "cannot be built without options" in failed["rewards:needsoptions"]
    assert "define contract_examples()" in failed["rewards:needsoptions"]
    assert "score() must take exactly one sample" in failed["rewards:takestwo"]
    assert failed["rewards:closesbadly"] == ("close() of the reward built with options {} raised RuntimeError: "
                                             "the judge's connection was already gone")
    assert "advantages must be a [B, R] = [4, 3] tensor, got torch.Size([4])" in failed["advantage_estimators:per_seq"]
    assert "the loss must be per token" in failed["policy_losses:scalar"]


def test_a_component_whose_package_is_not_installed_is_skipped_with_how_to_install_it(roll_plugins):
    """A tracker for a service whose client is an optional extra, or an engine not installed here:
    its checks cannot run, which is not the plugin's bug (its registration says what it needs)."""
    def trackers(register):
        register("remote", "roll_core.trackers:JsonlTracker", requires={"roll_no_such_client": "pip install client"})
        register("local", "roll_core.trackers:JsonlTracker")

    report = check_plugin("services", roll_plugins(("services", hooks(
        roll_register_trackers=trackers))))
    assert report.ok, report.failures()
    by_component = {r.component: (r.check, r.status, r.detail) for r in report.results}
    assert by_component["trackers:remote"] == (
        "requires", "skipped", "skipped: needs the 'roll_no_such_client' package, not installed here: pip install client")
    assert by_component["trackers:local"][1] == "ok"  # checked as usual


def test_unknown_and_broken_plugins(roll_plugins):
    plugins = roll_plugins()
    with pytest.raises(PluginError, match="no installed plugin or distribution 'core.reward'. Did you mean 'core.rewards'"):
        check_plugin("core.reward", plugins)

    def boom(register):
        raise RuntimeError("bad import")

    report = check_plugin("broken", roll_plugins(("broken", hooks(
        roll_register_rewards=boom))))
    assert not report.ok and "bad import" in report.failures()


def test_cli_exit_codes():
    ok = subprocess.run([sys.executable, "-m", "roll_core.cli", "check-plugin", "core.rewards"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "rewards:exact_match" in ok.stdout and "0 failed" in ok.stdout
    missing = subprocess.run([sys.executable, "-m", "roll_core.cli", "check-plugin", "nope"],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no installed plugin or distribution 'nope'" in missing.stderr


def test_kl_estimators_are_checked_on_distributions_when_registered_so(roll_plugins):
    def full_like(log_dist, ref_log_dist):
        return (log_dist.exp() * (log_dist - ref_log_dist)).sum(-1)

    plugin = hooks(roll_register_kl_estimators=lambda register: register("full_like", full_like, distribution=True))
    report = check_plugin("dist", roll_plugins(("dist", plugin)))
    assert report.ok, report.failures()
    assert "from [4, 3, 5] distributions" in report.results[0].detail
    assert torch.is_tensor(full_like(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2)))


def test_preference_and_distillation_losses_are_checked_on_sample_inputs(roll_plugins):
    def per_batch_dpo(inputs, *, beta, label_smoothing=0.0):  # wrong: one loss for the batch, not per pair
        return -(beta * (inputs.policy_chosen - inputs.policy_rejected)).sigmoid().log().mean(), {}

    def cross_entropy(student_logp, teacher_logp):  # wrong: not 0 for equal distributions
        return -(teacher_logp.exp() * student_logp).sum(-1)

    def squared_hellinger(student_logp, teacher_logp):
        return 1 - ((student_logp + teacher_logp) / 2).exp().sum(-1)

    plugin = hooks(
        roll_register_preference_losses=lambda register: register("per_batch", per_batch_dpo),
        roll_register_distill_losses=lambda register: (register("ce", cross_entropy),
                                                       register("hellinger", squared_hellinger)))
    report = check_plugin("pd", roll_plugins(("pd", plugin)))
    failures = {r.component: r.detail for r in report.results if r.status == "failed"}
    assert set(failures) == {"preference_losses:per_batch", "distill_losses:ce"}, report.results
    assert "per pair, [B] = [4]" in failures["preference_losses:per_batch"]
    assert "equal distributions must give 0" in failures["distill_losses:ce"]


def test_environments_are_checked_for_the_contract_and_determinism_under_a_seed(roll_plugins):
    import itertools

    from roll_core.envs import Env

    counter = itertools.count()

    class Deterministic(Env):
        def reset(self, seed=None):
            self.n = seed or 0
            return f"at {self.n}", {}

        def step(self, action):
            self.n += 1
            return f"at {self.n}", 0.0, self.n > 3, False, {}

    class IgnoresTheSeed(Deterministic):  # wrong: a process-wide counter, not the seed, draws the start
        def reset(self, seed=None):
            self.n = next(counter)
            return f"at {self.n}", {}

    class ReturnsFour(Deterministic):  # wrong: gym's old 4-tuple
        def step(self, action):
            return "x", 0.0, True, {}

    plugin = hooks(roll_register_envs=lambda register: (
        register("good", Deterministic), register("seedless", IgnoresTheSeed), register("four", ReturnsFour)))
    report = check_plugin("myenvs", roll_plugins(("myenvs", plugin)))
    failures = {(r.component, r.check): r.detail for r in report.results if r.status == "failed"}
    assert {("envs:seedless", "determinism under a seed"), ("envs:four", "episode")} <= set(failures), report.results
    assert not any(component == "envs:good" for component, _ in failures)
    assert "with seed 1234 and the same actions differ" in failures[("envs:seedless", "determinism under a seed")]
    assert "step() must return 5 values" in failures[("envs:four", "episode")]


def test_environments_with_image_observations_are_checked_by_their_pixels(roll_plugins):
    import numpy as np

    from roll_core.envs import Env, Observation

    class Pictures(Env):
        image_observations = True

        def reset(self, seed=None):
            self.rng = np.random.default_rng(seed)
            return Observation("<image>", [self.rng.integers(0, 255, (4, 4, 3), dtype=np.uint8)]), {}

        def step(self, action):
            return Observation("<image>", [self.rng.integers(0, 255, (4, 4, 3), dtype=np.uint8)]), 0.0, True, False, {}

    class Undeclared(Pictures):  # wrong: images without image_observations, which the run's checks read
        image_observations = False

    class Unmarked(Pictures):  # wrong: an image with no <image> in the text
        def step(self, action):
            return Observation("map", [np.zeros((4, 4, 3), np.uint8)]), 0.0, True, False, {}

    class Noisy(Pictures):  # wrong: pixels from the global RNG, not the seed
        def reset(self, seed=None):
            self.rng = np.random.default_rng()
            return super().step("")[0], {}

    plugin = hooks(roll_register_envs=lambda register: (
        register("good", Pictures), register("undeclared", Undeclared), register("unmarked", Unmarked),
        register("noisy", Noisy)))
    report = check_plugin("myenvs", roll_plugins(("myenvs", plugin)))
    failures = {r.component: r.detail for r in report.results if r.status == "failed"}
    assert set(failures) == {"envs:undeclared", "envs:unmarked", "envs:noisy"}, report.results
    assert "does not set image_observations = True" in failures["envs:undeclared"]
    assert "1 image(s) and 0 '<image>' placeholder(s)" in failures["envs:unmarked"]
    assert "with seed 1234 and the same actions differ" in failures["envs:noisy"]


def test_the_cli_exits_1_when_a_check_fails_and_checks_a_plugin_named_like_one_of_its_components(roll_plugins,
                                                                                                   capsys):
    from roll_core.cli import main
    from roll_core.rewards import ExactMatch

    roll_plugins(("bad", hooks(roll_register_rewards=lambda register: register("text", ReturnsText))),
                 ("same", hooks(roll_register_rewards=lambda register: register("same", ExactMatch))))
    assert main(["check-plugin", "bad"]) == 1
    counts = [sum(r.status == s for r in check_plugin("bad").results) for s in ("ok", "failed", "skipped")]
    assert counts[1] >= 1 and counts[0] + counts[2] >= 1  # failures among passes: the line counts each apart
    assert f"{counts[0]} passed, {counts[1]} failed, {counts[2]} skipped" in capsys.readouterr().out
    assert main(["check-plugin", "same"]) == 0  # the plugin, not the reward of that name in another plugin
    out = capsys.readouterr()
    assert "is not a plugin" not in out.err and "contract checks of 'same'" in out.out
