"""Plugin discovery through the ``roll`` entry-point group, in a real subprocess of the CLI; then the plugin
manager's rules (switches, withdrawal, order, taken names) in the test's own process."""

import json

import pytest

from conftest import metrics_of, run_roll

from roll_core.testing import hooks

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
        "train_strategies": ["fsdp2", "hf"], "infer_strategies": ["hf"], "critic_strategies": ["fsdp2", "hf"]}
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
    assert table.returncode == 0 and "roll_broken" in table.stdout and "broken: import failed" in table.stdout


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

    impostor = hooks(
        roll_register_rewards=lambda register: register("exact_match", "x:y"))
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
    step1 = metrics_of(out)[1]
    assert step1["train/half"] == 1.0  # the plugin's loss ran inside the training worker
    # a misspelled name lists the valid ones, including the plugin's
    result = run_roll("validate", "algorithm.advantage_estimator=sing", env_extra=env)
    assert result.returncode == 2 and "Did you mean 'sign'?" in result.stderr and "gigpo" in result.stderr


# -- the plugin manager in the test's own process: switches, withdrawal, metadata ----------------------------

def test_the_switches_take_spaced_lists_and_any_case_of_yes(monkeypatch):
    from roll_core import plugins

    monkeypatch.setenv("ROLL_DISABLE_PLUGINS", " core.trackers ,, roll-acme ,")
    assert plugins._env_list("ROLL_DISABLE_PLUGINS") == {"core.trackers", "roll-acme"}
    for value, strict in (("1", True), ("TRUE", True), ("Yes", True), ("0", False), ("no", False), ("", False)):
        monkeypatch.setenv("ROLL_STRICT_PLUGINS", value)
        assert plugins._strict() is strict, value


def test_a_disabled_plugin_is_never_imported(monkeypatch):
    from roll_core.plugins import RollPlugins

    def load():
        raise AssertionError("imported")

    monkeypatch.setenv("ROLL_DISABLE_PLUGINS", "acme-dist")
    p = RollPlugins()
    info = p.add("acme", load, module="acme.plugin", distribution="acme-dist", version="1.0")
    assert (info.status, info.error) == ("disabled", "") and not p.pm.has_plugin("acme")


def test_a_plugin_that_raises_in_a_later_hook_is_withdrawn_from_every_registry_and_from_pluggy(roll_plugins):

    def roll_register_trackers(register):
        raise RuntimeError("no tracker today")

    half = hooks(
        roll_register_rewards=lambda register: register("half_reward", "x:Y"),
        roll_register_trackers=roll_register_trackers)
    p = roll_plugins(("half", half))
    info = p.plugins["half"]
    assert info.status == "broken" and info.error == "roll_register_trackers raised RuntimeError: no tracker today"
    assert "half_reward" not in p.rewards and info.provides == {} and not p.pm.has_plugin("half")
    assert p.plugins["core.rewards"].status == "ok" and "exact_match" in p.rewards


def test_registries_are_attributes_and_other_names_are_not(roll_plugins):
    p = roll_plugins(entry_points=False)
    assert p.rewards is p.registry("rewards") and p.train_strategies is p.registry("train_strategies")
    assert getattr(p, "no_such_registry", None) is None and not hasattr(p, "no_such_registry")


def test_a_strategy_s_metadata_and_description_reach_its_registry(roll_plugins):

    def roll_register_strategies(register):
        register("mine", "roll_core.strategies.hf:HFTrainStrategy", kind="train", description="my trainer",
                 packed_sequences=True)
        register("mine", "roll_core.strategies.hf:HFInferStrategy", kind="infer")

    p = roll_plugins(("t", hooks(roll_register_strategies=roll_register_strategies)))
    entry = p.train_strategies.entry("mine")
    assert (entry.plugin, entry.description, entry.metadata) == ("t", "my trainer", {"packed_sequences": True})
    assert p.infer_strategies.entry("mine").description == "" and p.infer_strategies.entry("mine").metadata == {}
    assert p.provider_of("mine") == [("train strategy", "t"), ("infer strategy", "t")]
    info = p.plugins["t"]  # a plugin object handed in, not installed
    assert (info.distribution, info.version, info.builtin) == ("<in-process>", "", False)


def test_the_process_builds_its_plugins_once_until_reset():
    from roll_core.plugins import get_plugins, reset_plugins

    reset_plugins(None)
    try:
        first = get_plugins()
        assert get_plugins() is first
        reset_plugins(None)
        assert get_plugins() is not first
    finally:
        reset_plugins(None)


def test_entry_points_load_in_name_order_and_a_taken_name_is_refused_naming_its_owner(tmp_path, monkeypatch):
    import importlib.metadata as md

    from conftest import make_fake_distribution
    from roll_core.plugins import load_plugins

    sites = [make_fake_distribution(tmp_path / dist, dist, module, "", version="2.0")
             for dist, module in (("roll-zeta", "roll_zeta"), ("roll-alpha", "roll_alpha"),
                                  ("roll-alpha-fork", "roll_alpha"))]
    for site in sites:
        monkeypatch.syspath_prepend(str(site))
    found = [ep for site in sites for dist in md.distributions(path=[str(site)]) for ep in dist.entry_points]
    found.append(md.EntryPoint("roll_bare", "types", "roll"))  # an entry point that names no distribution
    monkeypatch.setattr(md, "entry_points", lambda group: [ep for ep in found if ep.group == group])
    p = load_plugins()
    third_party = [(name, info.distribution, info.status) for name, info in p.plugins.items() if not info.builtin]
    assert third_party == [("roll_alpha", "roll-alpha", "ok"),
                           ("roll_alpha@roll-alpha-fork", "roll-alpha-fork", "broken"),
                           ("roll_bare", "unknown", "ok"), ("roll_zeta", "roll-zeta", "ok")]
    fork = p.plugins["roll_alpha@roll-alpha-fork"]
    assert (fork.name, fork.version) == ("roll_alpha", "2.0")
    assert fork.error == "plugin name 'roll_alpha' is already taken by roll-alpha"
    assert p.plugins["roll_bare"].version == "unknown"
    assert all(info.builtin for info in load_plugins(entry_points=False).plugins.values())  # entry points skipped


def test_a_distribution_that_is_not_installed_has_an_unknown_version():
    from roll_core.plugins import _dist_version

    assert _dist_version("roll-core") not in ("", "unknown") and _dist_version("no-such-distribution") == "unknown"


def test_a_misspelled_hook_marks_its_plugin_broken_with_the_closest_hook_and_registers_nothing_of_it(
        roll_plugins, monkeypatch):
    from types import SimpleNamespace

    from roll_core import hookimpl
    from roll_core.errors import PluginError

    typo = hooks(roll_register_rewards=lambda register: register("typo_reward", "x:Y"),
                 roll_register_tracker=lambda register: register("typo_tracker", "x:Y"),
                 on_step_end=lambda metrics: None)
    newer = SimpleNamespace(roll_register_rewards=hookimpl(lambda register: register("newer_reward", "x:Y")),
                            roll_register_judges=hookimpl(optionalhook=True)(lambda register: None))
    p = roll_plugins(("typo", typo), ("newer", newer), entry_points=False)
    assert p.plugins["typo"].status == "broken" and p.plugins["typo"].error == (
        "it implements hooks that roll does not define and would never call: 'on_step_end' is not a "
        "roll hook. 'roll_register_tracker' is not a roll hook. Did you mean 'roll_register_trackers'? (a "
        "hook that only a newer roll defines is marked @hookimpl(optionalhook=True))")
    assert "typo_reward" not in p.rewards and "typo_tracker" not in p.trackers
    assert p.plugins["newer"].status == "ok" and "newer_reward" in p.rewards  # optional: another roll's hook
    assert p.plugins["core.rewards"].status == "ok"

    monkeypatch.setenv("ROLL_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match=r"^plugin 'typo' \(.*\) is broken: it implements hooks that roll"):
        roll_plugins(("typo", typo), entry_points=False)


def test_strict_mode_raises_naming_the_plugin_its_distribution_and_the_cause(monkeypatch, roll_plugins):
    from roll_core.errors import PluginError
    from roll_core.plugins import RollPlugins

    def load():
        raise ImportError("needs libfoo")

    monkeypatch.setenv("ROLL_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError) as failed:
        RollPlugins().add("acme", load, module="acme.plugin", distribution="acme-dist", version="1.0")
    assert str(failed.value) == ("plugin 'acme' (acme-dist 1.0) is broken: import failed: ImportError: needs libfoo. "
                                 "Unset ROLL_STRICT_PLUGINS to continue without it.")
    assert isinstance(failed.value.__cause__, ImportError)

    def roll_register_rewards(register):
        raise RuntimeError("no reward today")

    with pytest.raises(PluginError, match="roll_register_rewards raised RuntimeError: no reward today") as failed:
        roll_plugins(("late", hooks(roll_register_rewards=roll_register_rewards)))
    assert isinstance(failed.value.__cause__, RuntimeError)


def test_the_listing_names_the_python_every_plugin_and_every_component(roll_plugins):
    import importlib.metadata as md
    import sys

    def roll_register_rewards(register):
        register("plain_reward", "x:Y")  # no description

    p = roll_plugins(("t", hooks(roll_register_rewards=roll_register_rewards)),
                     entry_points=False)
    listing = p.listing()
    assert listing["python"] == {"version": sys.version.split()[0], "executable": sys.executable}
    rewards = next(info for info in listing["plugins"] if info["name"] == "core.rewards")
    assert rewards == {"name": "core.rewards", "module": "roll_core.default_plugins.rewards",
                       "distribution": "roll-core", "version": md.version("roll-core"), "status": "ok", "error": "",
                       "builtin": True, "provides": p.plugins["core.rewards"].provides,
                       "summary": "Built-in rewards."}  # its module's docstring, first sentence
    assert {"registry": "rewards", "kind": "reward", "name": "plain_reward", "plugin": "t",
            "description": ""} in listing["components"]


def test_a_plugin_that_registers_nothing_here_is_listed_with_its_own_summary(monkeypatch, capsys):
    """A plugin whose optional dependency is missing (roll-envs' ``gem``) registers nothing; the
    listing then shows its docstring's first sentence, which says why, instead of an empty cell."""
    import types

    from roll_core import hookimpl
    from roll_core.cli import main
    from roll_core.plugins import first_sentence, load_plugins, reset_plugins

    quiet = types.ModuleType("roll_quiet")
    quiet.__doc__ = """The ``quiet`` plugin: envs from libquiet,
    registered only when it is installed (pip install "libquiet>=2.0"). Other details."""
    quiet.roll_register_envs = hookimpl(lambda register: None)
    loud = types.ModuleType("roll_loud")
    loud.__doc__ = "Registers loud. Really."
    loud.roll_register_envs = hookimpl(lambda register: register("loud", "roll_loud:Env"))
    broken = types.ModuleType("roll_broken_hook")
    broken.__doc__ = "Never loads."

    def fails(register):
        raise RuntimeError("no libfoo")
    broken.roll_register_envs = hookimpl(fails)
    reset_plugins(load_plugins([("quiet", quiet), ("loud", loud), ("broken", broken)], entry_points=False))
    monkeypatch.setenv("COLUMNS", "250")
    try:
        assert main(["list-plugins"]) == 0
    finally:
        reset_plugins(None)
    rows = {line.split("│")[1].strip(): line.split("│")[5].strip() for line in capsys.readouterr().out.splitlines()
            if line.startswith("│") and line.split("│")[1].strip()}
    assert rows["quiet"] == ("nothing registered here. The quiet plugin: envs from libquiet, registered only when "
                             "it is installed (pip install \"libquiet>=2.0\").")
    assert rows["loud"] == "envs: loud"  # a plugin that provides something is listed by what it provides
    assert rows["broken"] == ""  # its status cell says what went wrong
    assert first_sentence(None) == "" and first_sentence("No full stop") == "No full stop"


def test_a_disabled_name_that_matches_no_plugin_is_a_warning_with_the_closest_name(roll_plugins, monkeypatch, capsys):
    """ROLL_DISABLE_PLUGINS with a typo disables nothing; the command says so, once, and goes on."""
    from roll_core.cli import main

    from roll_core.testing import hooks

    # extra: a plugin that is there; roll-core: a distribution that is there
    monkeypatch.setenv("ROLL_DISABLE_PLUGINS", "core.rewardz, extra,zzzzzz,roll-core")
    roll_plugins(("extra", hooks()), entry_points=False)
    assert main(["list-plugins", "--json"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "warning: ROLL_DISABLE_PLUGINS names 'core.rewardz', which no installed plugin or distribution has: it "
        "disables nothing. Did you mean 'core.rewards'?",
        "warning: ROLL_DISABLE_PLUGINS names 'zzzzzz', which no installed plugin or distribution has: it disables "
        "nothing."]
