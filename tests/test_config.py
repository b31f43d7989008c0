import re
from pathlib import Path
from typing import Literal

import pytest

from conftest import run_roll
from roll_core.config import check_registry_names, load_and_check, load_config
from roll_core.errors import ConfigError

ROOT = Path(__file__).parents[1]


def write(tmp_path, text):
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


def test_defaults_are_the_quickstart():
    cfg = load_config()
    assert cfg.model.path == "tiny" and cfg.data.dataset == "carry_addition"
    assert cfg.algorithm.advantage_estimator == "grpo" and cfg.executor == "ray"
    check_registry_names(cfg)


def test_misspelled_nested_key_is_named_with_suggestion(tmp_path):
    path = write(tmp_path, "rollout:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert str(path) in msg and "unknown key 'rollout.temprature'" in msg and "Did you mean 'temperature'?" in msg


def test_misspelled_top_level_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'trainr'\. Did you mean 'trainer'\?"):
        load_config(write(tmp_path, "trainr:\n  max_steps: 3\n"))


def test_misspelled_override_key():
    with pytest.raises(ConfigError, match=r"unknown key 'algorithm.kl_los_coef'\. Did you mean 'kl_loss_coef'\?"):
        load_config(None, ["algorithm.kl_los_coef=0.1"])


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"key 'trainer.max_steps'.*'many'"):
        load_config(None, ["trainer.max_steps=many"])


def test_overrides_parse_yaml_values():
    cfg = load_config(None, ["rollout.temperature=0.5", "trackers=[jsonl]", "roles.reference=null"])
    assert cfg.rollout.temperature == 0.5 and cfg.trackers == ["jsonl"] and cfg.roles.reference is None


def test_cross_field_check():
    with pytest.raises(ConfigError, match="need a reference role"):
        load_config(None, ["roles.reference=null", "algorithm.kl_loss_coef=0.1"])


@pytest.mark.parametrize(
    "override, key, valid",
    [
        ("roles.reward.name=exact_mtch", "roles.reward.name", "Did you mean 'exact_match'?"),
        ("roles.actor_train.strategy=hff", "roles.actor_train.strategy", "Did you mean 'hf'? Valid names: "),
        ("algorithm.advantage_estimator=grop", "algorithm.advantage_estimator", "Did you mean 'grpo'?"),
        ("algorithm.policy_loss=gpso", "algorithm.policy_loss", "Valid names: cispo, dual_clip, gspo, kimi,"),
        ("algorithm.kl_penalty.estimator=k4", "algorithm.kl_penalty.estimator", "Valid names: abs, full, k1, k2, k3"),
        ("roles.critic.strategy=hff", "roles.critic.strategy", "Did you mean 'hf'? Valid names: "),
        ("trackers=[stdout,wandbb]", "trackers[1]", "Did you mean 'wandb'? Valid names: jsonl, stdout, swanlab, tensorboard, wandb"),
        ("runtime.weight_sync=colective", "runtime.weight_sync", "Did you mean 'collective'? Valid names: collective, in_process, object_store, shared_memory"),
        ("rollout.scheduler=asyncc", "rollout.scheduler", "Did you mean 'async'? Valid names: async, sync"),
    ],
)
def test_unknown_registry_names_list_valid_ones(override, key, valid):
    with pytest.raises(ConfigError) as err:
        load_and_check(None, [override])
    assert f"key '{key}'" in str(err.value) and valid in str(err.value)


def test_missing_model_directory_is_explained(tmp_path):
    with pytest.raises(ConfigError, match="model.path.*never downloads"):
        load_and_check(None, [f"model.path={tmp_path / 'nope'}"])


def test_cli_validate_misspelled_key_exits_nonzero_with_one_message(tmp_path):
    path = write(tmp_path, "rollout:\n  num_return_sequence: 4\n")
    result = run_roll("validate", str(path))
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if line]
    assert len(lines) == 1, result.stderr
    assert "unknown key 'rollout.num_return_sequence'" in lines[0]
    assert "Did you mean 'num_return_sequences'?" in lines[0]
    assert "Traceback" not in result.stderr


def test_cli_validate_unknown_reward_lists_valid(tmp_path):
    result = run_roll("validate", str(write(tmp_path, "roles:\n  reward:\n    name: exactmatch\n")))
    assert result.returncode == 2 and re.search(r"Valid names: (\w+, )*exact_match", result.stderr)


def test_cli_validate_ok():
    result = run_roll("validate", str(ROOT / "examples" / "quickstart.yaml"))
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_validate(path, tiny_model_path):
    import yaml

    from roll_core.config.loader import PLUGIN_PACKAGES
    from roll_core.plugins import get_plugins

    config = yaml.safe_load(path.read_text()) or {}
    roles = config.get("roles", {})
    for role in roles.values():
        name = (role or {}).get("strategy")
        if name in PLUGIN_PACKAGES and name not in get_plugins().infer_strategies \
                and name not in get_plugins().train_strategies:
            pytest.skip(f"{path.name} needs the {PLUGIN_PACKAGES[name]} plugin, not installed here (its own "
                        "nox session validates it)")
    # a model another run writes (opd.yaml's teacher: the quickstart's policy; lora.yaml's base: its
    # warmed-up model) is replaced by a tiny model when that run has not happened here
    written = [f"roles.{name}.model_path={tiny_model_path}" for name, role in roles.items()
               if (role or {}).get("model_path") and not (ROOT / role["model_path"]).exists()]
    base = (config.get("model") or {}).get("path", "tiny")
    if base != "tiny" and not (ROOT / base).exists():
        written.append(f"model.path={tiny_model_path}")
    load_and_check(path, written)


def test_reward_options_are_checked_against_the_reward_before_workers_start(roll_plugins):
    from roll_core.rewards import Reward
    from roll_core.testing import hooks

    class Graded(Reward):
        def __init__(self, threshold: float, partial: bool = True):
            self.threshold, self.partial = threshold, partial

        def score(self, sample):
            return 0.0

    roll_plugins(("t", hooks(
        roll_register_rewards=lambda register: register("graded", Graded))))
    with pytest.raises(ConfigError, match=r"unknown option 'partal'. Did you mean 'partial'\? Valid options: threshold, partial"):
        load_and_check(None, ["roles.reward.name=graded", "roles.reward.options.threshold=1",
                              "roles.reward.options.partal=false"])
    with pytest.raises(ConfigError, match=r"missing required option\(s\) threshold"):
        load_and_check(None, ["roles.reward.name=graded"])
    with pytest.raises(ConfigError, match="reward 'exact_match'.*unknown option 'strict'"):
        load_and_check(None, ["roles.reward.options.strict=true"])
    load_and_check(None, ["roles.reward.name=graded", "roles.reward.options.threshold=0.5"])


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.kl_estimator=k9"], "key 'algorithm.kl_estimator': unknown kl estimator 'k9'"),
    (["roles.reference=null", "algorithm.kl_penalty.coef=0.1"], "need a reference role"),
    (["algorithm.difficulty_mask={low: 0.5, high: 0.5}"], "low (0.5) must be below high (0.5)"),
    (["data.domains={a: {dataset: carry_addition}, b: {dataset: carry_addition}}",
      "data.domain_interleave_probs={a: 1.5, b: -0.5}"], "must be non-negative and sum to 1"),
])
def test_invalid_settings_are_named(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_and_check(None, overrides)
    assert message in str(err.value)


def test_validate_imports_what_the_config_names(roll_plugins):
    from roll_core.testing import hooks

    roll_plugins(("typo", hooks(
        roll_register_rewards=lambda register: register("typo_reward", "roll_no_such_module.rewards:Thing"))))
    with pytest.raises(ConfigError) as err:
        load_and_check(None, ["roles.reward.name=typo_reward"])
    assert "key 'roles.reward.name'" in str(err.value) and "roll_no_such_module" in str(err.value)
    assert "plugin 'typo'" in str(err.value)


def test_cli_validate_without_a_config_checks_the_embedded_default(capsys):
    from roll_core.cli import main

    assert main(["validate"]) == 0
    assert "the embedded default: ok (pipeline 'rlvr'" in capsys.readouterr().out
    assert main(["validate", "trainer.max_steps=3"]) == 0
    assert main(["validate", "trainer.max_stepz=3"]) == 2


def test_reward_option_values_are_checked_and_coerced_to_the_declared_types(roll_plugins):
    from roll_core.rewards import Reward
    from roll_core.testing import hooks

    class Typed(Reward):
        def __init__(self, explode_on: str = "x", threshold: float = 0.5, rounds: int | None = None,
                     strict: bool = False, extra: dict | None = None, mode: Literal["fast", "slow", 3] = "fast"):
            self.explode_on = explode_on

        def score(self, sample):
            return 0.0

    roll_plugins(("t", hooks(roll_register_rewards=lambda register: register("typed", Typed))))
    cfg = load_and_check(None, ["roles.reward.name=typed", "roles.reward.options.explode_on=9",
                                "roles.reward.options.threshold=1", "roles.reward.options.strict=true",
                                "roles.reward.options.extra={a: 1}", "roles.reward.options.mode=3"])
    assert cfg.roles.reward.options == {"explode_on": "9", "threshold": 1.0, "strict": True, "extra": {"a": 1},
                                        "mode": 3}
    with pytest.raises(ConfigError) as err:
        load_and_check(None, ["roles.reward.name=typed", "roles.reward.options.threshold=high",
                              "roles.reward.options.rounds=2.5", "roles.reward.options.mode=slwo"])
    message = str(err.value)
    assert "key 'roles.reward.options' for reward 'typed': option 'threshold' must be float, got 'high'" in message
    assert "option 'rounds' must be int, got 2.5" in message
    assert "option 'mode' must be one of 'fast', 'slow', 3, got 'slwo'. Did you mean 'slow'?" in message
    with pytest.raises(ConfigError, match=r"option 'mode' must be one of 'fast', 'slow', 3, got 4$"):
        load_and_check(None, ["roles.reward.name=typed", "roles.reward.options.mode=4"])


def test_resume_guard_compares_flattened_configs_outside_the_resumable_keys():
    from roll_core.config.resume import check_resume, flatten, meaningful_changes

    assert flatten({"a": {"b": 1, "c": {}}, "d": 2}) == {"a.b": 1, "a.c": {}, "d": 2}
    saved = {"output_dir": "runs/x", "trainer": {"max_steps": 10}, "roles": {"actor_train": {"num_workers": 1}},
             "algorithm": {"policy_loss": "ppo_clip"}, "seed": 0}
    resumable = {**saved, "trainer": {"max_steps": 20}, "roles": {"actor_train": {"num_workers": 2}}}
    assert meaningful_changes(saved, resumable) == []
    check_resume(saved, resumable, "ckpt")  # passes
    check_resume(None, resumable, "ckpt")  # a checkpoint without a recorded config passes
    changed = {**saved, "algorithm": {"policy_loss": "gspo"}, "extra": 1}
    del changed["seed"]
    assert meaningful_changes(saved, changed) == [("algorithm.policy_loss", "ppo_clip", "gspo"), ("extra", None, 1),
                                                  ("seed", 0, None)]
    with pytest.raises(ConfigError, match=r"checkpoint ckpt\): algorithm.policy_loss: 'ppo_clip' -> 'gspo'; "
                                          r"extra: None -> 1; seed: 0 -> None\. Resuming"):
        check_resume(saved, changed, "ckpt")


def test_resume_guard_takes_keys_added_since_the_checkpoint_at_their_defaults():
    from roll_core.config.resume import check_resume, meaningful_changes

    defaults = {"dpo": {"beta": 0.1, "loss_options": {}}, "roles": {"critic": {"lr": 1.0}}, "output_dir": "o"}
    saved = {"output_dir": "o", "dpo": {"beta": 0.1}, "roles": {"critic": None}}  # written before loss_options
    current = {"output_dir": "o", "dpo": {"beta": 0.1, "loss_options": {}}, "roles": {"critic": None}}
    assert meaningful_changes(saved, current, defaults) == []
    assert meaningful_changes(saved, current) == [("dpo.loss_options", None, {})]  # without the defaults
    assert meaningful_changes(saved, {**current, "dpo": {"beta": 0.1, "loss_options": {"gamma": 1}}}, defaults) == [
        ("dpo.loss_options.gamma", None, 1)]  # set to something else: a change
    # a critic added now is a change, though its keys are missing from the saved config
    with_critic = {**current, "roles": {"critic": {"lr": 1.0}}}
    assert meaningful_changes(saved, with_critic, defaults) == [("roles.critic", None, None),
                                                                ("roles.critic.lr", None, 1.0)]
    full = load_config(None, []).model_dump(mode="json")
    older = {**full, "dpo": {k: v for k, v in full["dpo"].items() if k != "loss_options"}}
    check_resume(older, full, "ckpt")  # the schema's own defaults fill it


def test_each_pipeline_resumes_whatever_the_sections_it_does_not_read_say(roll_plugins):
    from roll_core.config.resume import check_resume, flatten
    from roll_core.pipelines import Pipeline
    from roll_core.pipelines.dpo import DPOPipeline
    from roll_core.pipelines.online_dpo import OnlineDPOPipeline
    from roll_core.pipelines.rlvr import RLVRPipeline

    plugins = roll_plugins()
    saved = load_config(None, []).model_dump(mode="json")
    saved["dpo"]["average_log_probs"] = False  # as roll wrote it before the key's null default
    current = load_config(None, ["dpo.beta=0.2", "distill.loss=reverse_kl"]).model_dump(mode="json")
    check_resume(saved, current, "ckpt", lambda flat: RLVRPipeline.resume_view(flat, plugins))  # rlvr reads neither
    for pipeline in (Pipeline, DPOPipeline, OnlineDPOPipeline):  # reads them all; reads dpo.beta
        with pytest.raises(ConfigError, match="dpo.beta: 0.1 -> 0.2"):
            check_resume(saved, current, "ckpt", lambda flat: pipeline.resume_view(flat, plugins))
    view = RLVRPipeline.resume_view(flatten(current), plugins)
    assert "warmup.steps" in view and "rollout.temperature" in view and not any(
        key.startswith(("dpo.", "distill.", "agentic.", "reward_model.")) for key in view)

    # every built-in pipeline: a change in a section it reads is refused, in one it does not resumes
    one_change = {"warmup": "warmup.steps=7", "dpo": "dpo.beta=0.2", "reward_model": "reward_model.batch_size=3",
                  "distill": "distill.temperature=2.0", "agentic": "agentic.env=other"}
    reads = {"rlvr": {"warmup"}, "sft": {"warmup"}, "dpo": {"dpo"}, "online_dpo": {"warmup", "dpo"},
             "reward_model": {"reward_model"}, "distill": {"distill"}, "agentic": {"warmup", "agentic"}}
    assert set(reads) <= set(plugins.pipelines.names())
    base = load_config(None, []).model_dump(mode="json")
    for name, sections in reads.items():
        pipeline = plugins.pipelines.get(name)
        for section, override in one_change.items():
            changed = load_config(None, [override]).model_dump(mode="json")
            if section in sections:
                with pytest.raises(ConfigError, match=override.split("=")[0]):
                    check_resume(base, changed, "ckpt", lambda flat: pipeline.resume_view(flat, plugins))
            else:
                check_resume(base, changed, "ckpt", lambda flat: pipeline.resume_view(flat, plugins))

    # dpo.average_log_probs: null is the loss's choice: sums for dpo_sigmoid, means for simpo
    current = load_config(None, []).model_dump(mode="json")
    for pipeline in (DPOPipeline, OnlineDPOPipeline):
        check_resume(saved, current, "ckpt", lambda flat: pipeline.resume_view(flat, plugins))
        simpo = {**saved, "dpo": {**saved["dpo"], "loss": "simpo"}}
        with pytest.raises(ConfigError, match="dpo.average_log_probs: False -> True"):
            check_resume(simpo, {**current, "dpo": {**current["dpo"], "loss": "simpo"}}, "ckpt",
                         lambda flat: pipeline.resume_view(flat, plugins))
    unknown = flatten({**current, "dpo": {**current["dpo"], "loss": "gone"}})
    assert DPOPipeline.resume_view(unknown, plugins)["dpo.average_log_probs"] is None  # compared as saved


def test_resume_guard_shortens_long_values_and_counts_the_rest():
    from roll_core.config.resume import check_resume

    saved = {"output_dir": "o", **{f"k{i}": i for i in range(10)}, "a_long": "x" * 100}
    current = {"output_dir": "o", **{f"k{i}": i + 1 for i in range(10)}, "a_long": "y" * 100}
    with pytest.raises(ConfigError) as err:
        check_resume(saved, current, "c")
    text = str(err.value)
    assert "(and 3 more)" in text  # 11 changes, 8 shown
    assert "a_long: '" + "x" * 56 + "... -> '" + "y" * 56 + "..." in text


def test_an_eval_reward_is_checked_like_the_training_reward_and_only_where_it_is_read():
    with pytest.raises(ConfigError, match=r"key 'roles.eval_reward.name': unknown reward 'exact_mach'. "
                                          r"Did you mean 'exact_match'\?"):
        load_and_check(None, ["roles.eval_reward={name: exact_mach}"])
    with pytest.raises(ConfigError, match=r"key 'roles.eval_reward.options' for reward 'exact_match': unknown "
                                          r"option 'strp'. Did you mean 'strip'\?"):
        load_and_check(None, ["roles.eval_reward={name: exact_match, options: {strp: true}}"])
    with pytest.raises(ConfigError, match="key 'roles.eval_reward': pipeline dpo evaluates without a reward, so "
                                          "the role would never be read"):
        load_and_check(None, ["pipeline=dpo", "roles.eval_reward={name: exact_match}"])
    load_and_check(None, ["pipeline=online_dpo", "roles.eval_reward={name: exact_match}"])  # rlvr's evaluation
    cfg = load_and_check(None, ["roles.eval_reward={name: exact_match}"])
    assert list(cfg.roles.reward_roles()) == ["roles.reward", "roles.eval_reward"]
    assert "eval_reward" in cfg.roles.named()
