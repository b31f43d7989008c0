"""Plugin discovery through the ``roll`` entry-point group, in a real subprocess of the CLI."""

import json

from conftest import run_roll

GOOD = """
from roll_core import hookimpl
from roll_core.rewards import Reward

class Shout(Reward):
    def score(self, sample):
        return float(sample.response.isupper())

@hookimpl
def roll_register_rewards(register):
    register("shout", "roll_acme_rewards:Shout", description="1 if the response is upper case")
"""

BROKEN_IMPORT = """
raise ImportError("needs libfoo, which is not installed")
"""

HEAVY = """
import sys
from roll_core import hookimpl

@hookimpl
def roll_register_strategies(register):
    # a lazy target: listing must not import it
    register("heavy", "roll_heavy_backend_impl:Strategy", kind="infer")
"""


def listing(env):
    result = run_roll("list-plugins", "--json", env_extra=env)
    assert result.returncode == 0, result.stderr
    return {p["name"]: p for p in json.loads(result.stdout)["plugins"]}, json.loads(result.stdout)


def test_default_plugins_are_listed_with_what_they_provide():
    plugins, full = listing({})
    core = {n: p for n, p in plugins.items() if p["distribution"] == "roll-core"}
    assert {"core.strategies", "core.algorithms", "core.rewards", "core.trackers", "core.pipelines"} <= set(core)
    assert all(p["status"] == "ok" and p["builtin"] for p in core.values())
    provides = plugins["core.algorithms"]["provides"]
    assert provides["advantage_estimators"] == sorted([
        "gae", "grpo", "rloo", "reinforce", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "raft",
        "step_reinforce", "agentic_reinforce", "gigpo", "opd"])
    assert provides["policy_losses"] == sorted(
        ["ppo_clip", "dual_clip", "vanilla_pg", "gspo", "tis", "topr", "cispo", "kimi"])
    assert provides["kl_estimators"] == ["abs", "full", "k1", "k2", "k3"]
    assert plugins["core.strategies"]["provides"] == {
        "train_strategies": ["fsdp2", "hf"], "infer_strategies": ["hf"], "critic_strategies": ["hf"]}
    assert full["python"]["version"].count(".") == 2 and full["python"]["executable"]


def test_installed_distribution_appears_and_its_reward_is_usable(fake_dist, tmp_path):
    site = fake_dist("roll-acme-rewards", "roll_acme_rewards", GOOD, version="1.2.3")
    env = {"PYTHONPATH": str(site)}
    plugins, _ = listing(env)
    acme = plugins["roll_acme_rewards"]
    assert acme["distribution"] == "roll-acme-rewards" and acme["version"] == "1.2.3"
    assert acme["status"] == "ok" and acme["provides"] == {"rewards": ["shout"]}
    cfg = tmp_path / "c.yaml"
    cfg.write_text("roles:\n  reward:\n    name: shout\n")
    result = run_roll("validate", str(cfg), env_extra=env)
    assert result.returncode == 0, result.stderr
    # without the distribution, the same config names the valid rewards
    result = run_roll("validate", str(cfg))
    assert result.returncode == 2 and "unknown reward 'shout'" in result.stderr


def test_broken_plugin_is_reported_and_the_cli_keeps_working(fake_dist):
    site = fake_dist("roll-broken", "roll_broken", BROKEN_IMPORT, version="0.9")
    plugins, _ = listing({"PYTHONPATH": str(site)})
    broken = plugins["roll_broken"]
    assert broken["status"] == "broken" and broken["version"] == "0.9"
    assert "ImportError: needs libfoo" in broken["error"]
    assert plugins["core.rewards"]["status"] == "ok"
    table = run_roll("list-plugins", env_extra={"PYTHONPATH": str(site), "COLUMNS": "200"})
    assert table.returncode == 0 and "roll_broken" in table.stdout and "broken" in table.stdout


def test_strict_mode_makes_a_broken_plugin_fatal(fake_dist):
    site = fake_dist("roll-broken", "roll_broken", BROKEN_IMPORT)
    result = run_roll("list-plugins", env_extra={"PYTHONPATH": str(site), "ROLL_STRICT_PLUGINS": "1"})
    assert result.returncode == 2
    assert "plugin 'roll_broken'" in result.stderr and "libfoo" in result.stderr


def test_disable_plugins_by_name(fake_dist):
    site = fake_dist("roll-acme-rewards", "roll_acme_rewards", GOOD)
    plugins, _ = listing({"PYTHONPATH": str(site), "ROLL_DISABLE_PLUGINS": "roll-acme-rewards,core.trackers"})
    assert plugins["roll_acme_rewards"]["status"] == "disabled"
    assert plugins["core.trackers"]["status"] == "disabled" and plugins["core.trackers"]["provides"] == {}


def test_listing_imports_no_heavy_backend(fake_dist):
    site = fake_dist("roll-heavy", "roll_heavy", HEAVY)
    code = ("import sys; from roll_core.plugins import get_plugins; p = get_plugins(); "
            "assert 'heavy' in p.infer_strategies; "
            "print(sorted(m for m in ('torch', 'transformers', 'ray', 'roll_heavy_backend_impl') if m in sys.modules))")
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_duplicate_name_from_two_plugins_names_both(roll_plugins):
    import types

    from roll_core import hookimpl

    impostor = types.SimpleNamespace(
        roll_register_rewards=hookimpl(lambda register: register("exact_match", "x:y")))
    p = roll_plugins(("impostor", impostor))
    info = p.plugins["impostor"]
    assert info.status == "broken"
    assert "'core.rewards'" in info.error and "'impostor'" in info.error
    assert p.rewards.entry("exact_match").plugin == "core.rewards"


ALGORITHMS = '''
"""A third-party algorithm package: one advantage estimator and one policy loss."""
import torch
from roll_core import hookimpl


def sign_advantage(batch, config):
    """+1 / -1 by comparison with the group's mean score (a toy estimator of a research package)."""
    from roll_core.algorithms.advantages import group_stats
    scores = (batch.token_level_rewards * batch.response_mask).sum(-1)
    mean, _, _ = group_stats(scores, batch.group_index)
    adv = torch.sign(scores - mean)[:, None] * batch.response_mask
    return adv, adv


def half_pg(inputs, config):
    return -0.5 * inputs.advantages * inputs.log_prob, {"half": 1.0}


@hookimpl
def roll_register_advantage_estimators(register):
    register("sign", sign_advantage, description="sign of r - mean(group)")


@hookimpl
def roll_register_policy_losses(register):
    register("half_pg", half_pg, description="half a policy gradient")
'''


def test_third_party_estimator_and_loss_are_listed_and_used_by_name(fake_dist, tmp_path):
    site = fake_dist("roll-acme-algos", "roll_acme_algos", ALGORITHMS)
    env = {"PYTHONPATH": str(site)}
    plugins, _ = listing(env)
    assert plugins["roll_acme_algos"]["provides"] == {"advantage_estimators": ["sign"], "policy_losses": ["half_pg"]}
    out = tmp_path / "run"
    result = run_roll(
        "run", "algorithm.advantage_estimator=sign", "algorithm.policy_loss=half_pg", f"output_dir={out}",
        "executor=local", "warmup.steps=2", "rollout.prompts_per_step=2", "rollout.num_return_sequences=4",
        "trainer.max_steps=1", "trainer.eval_every=0", "data.eval_size=4", "trackers=[jsonl]", env_extra=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    step1 = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1]
    assert step1["train/half"] == 1.0  # the plugin's loss ran inside the training worker
    # a misspelled name lists the valid ones, including the plugin's
    result = run_roll("validate", "algorithm.advantage_estimator=sing", env_extra=env)
    assert result.returncode == 2 and "Did you mean 'sign'?" in result.stderr and "gigpo" in result.stderr
