"""The loader's messages, whole: a user reads them, so a changed word or a dropped clause is a
defect these tests catch (substring matches would not)."""

import pytest

from roll_core.config import load_and_check, load_config
from roll_core.config.loader import _yaml, apply_overrides, parse_override, registry_references
from roll_core.config.schema import RolloutConfig
from roll_core.errors import ConfigError


def error(*args) -> str:
    with pytest.raises(ConfigError) as err:
        load_and_check(*args)
    return str(err.value)


def test_every_name_the_config_uses_is_listed_with_its_key_and_registry():
    cfg = load_config(None, [
        "trackers=[jsonl, tensorboard]", "runtime.weight_sync=object_store", "roles.critic={}",
        "data.domains={a: {dataset: carry_addition}, b: {train_file: b.jsonl}}",
        "data.domain_interleave_probs={a: 0.5, b: 0.5}",
        "roles.domain_rewards={b: {rewards: [{name: exact_match}, {name: choice, weight: 2}]}}",
        "roles.teacher={kind: infer, model_path: t}",  # a role of one's own: its strategy is checked too
    ])
    assert registry_references(cfg) == [
        ("pipeline", "pipelines", "rlvr"),
        ("rollout.scheduler", "schedulers", "sync"),
        ("algorithm.advantage_estimator", "advantage_estimators", "grpo"),
        ("algorithm.policy_loss", "policy_losses", "ppo_clip"),
        ("algorithm.kl_estimator", "kl_estimators", "k3"),
        ("algorithm.kl_penalty.estimator", "kl_estimators", "k1"),
        ("dpo.loss", "preference_losses", "dpo_sigmoid"),
        ("distill.loss", "distill_losses", "forward_kl"),
        ("roles.actor_train.strategy", "train_strategies", "hf"),
        ("roles.actor_infer.strategy", "infer_strategies", "hf"),
        ("roles.reference.strategy", "infer_strategies", "hf"),
        ("roles.critic.strategy", "critic_strategies", "hf"),
        ("roles.teacher.strategy", "infer_strategies", "hf"),
        ("roles.reward.name", "rewards", "exact_match"),
        ("roles.domain_rewards.b.rewards[0].name", "rewards", "exact_match"),
        ("roles.domain_rewards.b.rewards[1].name", "rewards", "choice"),
        ("data.domains.a.dataset", "datasets", "carry_addition"),
        ("runtime.weight_sync", "weight_syncs", "object_store"),
        ("trackers[0]", "trackers", "jsonl"),
        ("trackers[1]", "trackers", "tensorboard"),
    ]
    plain = registry_references(load_config(None, ["roles.reference=null", "algorithm.kl_penalty.coef=0",
                                                   "data.train_file=t.jsonl", "trackers=[]"]))
    assert [key for key, _, _ in plain] == [
        "pipeline", "rollout.scheduler", "algorithm.advantage_estimator", "algorithm.policy_loss",
        "algorithm.kl_estimator", "algorithm.kl_penalty.estimator", "dpo.loss", "distill.loss", "roles.actor_train.strategy",
        "roles.actor_infer.strategy", "roles.reward.name"]


def test_unknown_names_and_missing_roles_are_reported_together():
    assert error(None, ["algorithm.advantage_estimator=gae", "algorithm.policy_loss=nope"]) == (
        "config error in the default config: key 'algorithm.policy_loss': unknown policy loss 'nope'. Valid names: cispo, dual_clip, "
        "gspo, kimi, ppo_clip, tis, topr, vanilla_pg. If a plugin provides it: is it installed in this Python "
        "environment (roll list-plugins), and not disabled by ROLL_DISABLE_PLUGINS?; "
        "key 'algorithm.advantage_estimator': 'gae' needs "
        "roles.critic, which is not configured")
    assert error(None, ["algorithm.advantage_estimator=opd", "roles.reference=null",
                        "algorithm.kl_penalty.coef=0"]) == (
        "config error in the default config: key 'algorithm.advantage_estimator': 'opd' needs roles.reference, which is not configured")
    load_and_check(None, ["algorithm.advantage_estimator=gae", "roles.critic={}"])


def test_missing_files_and_model_directories_are_each_named(tmp_path):
    (tmp_path / "model").mkdir()
    assert error(None, ["data.train_file=/nope.jsonl", "data.eval_file=/nope2.jsonl", f"model.path={tmp_path}/model",
                        "roles.reference.model_path=/ref"]) == (
        "config error in the default config: key 'data.train_file': file '/nope.jsonl' does not exist; key 'data.eval_file': file "
        f"'/nope2.jsonl' does not exist; key 'model.path': '{tmp_path}/model' is not a Hugging Face model directory "
        "(no config.json); roll never downloads from a hub at run time, point it at a local checkpoint; key "
        "'roles.reference.model_path': '/ref' is not a Hugging Face model directory (no config.json); roll never "
        "downloads from a hub at run time, point it at a local checkpoint")
    assert "data.domains.a.eval_file" in error(None, [
        "data.domains={a: {dataset: carry_addition, eval_file: /e.jsonl}}", "data.domain_interleave_probs={a: 1}"])
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "t.jsonl").write_text("")
    load_and_check(None, [f"model.path={tmp_path}/model", f"data.train_file={tmp_path}/t.jsonl"])


def test_options_for_a_component_without_an_options_model_are_refused():
    assert error(None, ["algorithm.policy_loss_options={clip: 1, alpha: 2}"]) == (
        "config error in the default config: key 'algorithm.policy_loss_options': policy loss 'ppo_clip' takes no options, "
        "got ['alpha', 'clip']")
    assert error(None, ["algorithm.advantage_estimator_options={x: 1}"]) == (
        "config error in the default config: key 'algorithm.advantage_estimator_options': advantage estimator 'grpo' takes no options, "
        "got ['x']")


def test_schema_errors_name_each_key_with_the_value_and_a_suggestion(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.temperature=hot", "rolout.x=1"])
    assert str(err.value) == (
        "config error in the default config (with command-line overrides): key 'rollout.temperature': Input should "
        "be a valid number, unable to parse string as a number (got 'hot'); unknown key 'rolout'. Did you mean "
        "'rollout'?")
    path = tmp_path / "c.yaml"
    path.write_text("roles:\n  reward:\n    nmae: x\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"config error in {path}: unknown key 'roles.reward.nmae'. Did you mean 'name'?"
    path.write_text("rollout:\n  temperature: 0.5\nrollout:\n  top_p: 0.9\n")  # PyYAML would keep the second
    with pytest.raises(ConfigError, match=r"not valid YAML: key 'rollout' is written twice in one mapping \(lines 1 "
                                          r"and 3\); YAML would keep only the second"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"override 'rollout=\{top_p: 1, top_p: 2\}': value is not valid YAML "
                                          r"\(key 'top_p' is written twice"):
        load_config(None, ["rollout={top_p: 1, top_p: 2}"])
    path.write_text("base: &b {temperature: 0.5, top_p: 0.8}\nrollout: {<<: *b, temperature: 0.7}\n")
    # a merge key's values may be overridden
    assert _yaml(path.read_text())["rollout"] == {"temperature": 0.7, "top_p": 0.8}
    path.write_text("rollout:\n  temperature: [1]\n  unknown: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"config error in {path}: key 'rollout.temperature': ")
    assert str(err.value).endswith("; unknown key 'rollout.unknown'. The keys of 'rollout': " + ", ".join(
        RolloutConfig.model_fields) + ".")  # nothing close: every key that is there


def test_roles_are_named_entries_with_a_kind_and_mistakes_name_the_key():
    cfg = load_config(None, ["roles.teacher={kind: infer, model_path: t}", "roles.lake={kind: env, num_workers: 3}",
                             "distill.teacher=teacher", "pipeline=agentic", "agentic.role=lake"])
    assert {n: r.kind for n, r in cfg.roles.named().items()} == {
        "actor_train": "train", "actor_infer": "infer", "reference": "infer", "reward": "reward", "env": "env",
        "teacher": "infer", "lake": "env"}
    assert list(cfg.placed_roles()) == ["actor_train", "actor_infer", "reference", "reward", "teacher"]  # env: no devices
    assert list(cfg.model_roles()) == ["actor_train", "actor_infer", "reference", "teacher"]
    assert cfg.role("lake").num_workers == 3 and cfg.agentic.environments()[0].role == "lake"

    def message(*overrides: str) -> str:
        with pytest.raises(ConfigError) as err:
            load_config(None, list(overrides))
        return str(err.value).removeprefix("config error in the default config (with command-line overrides): ")

    assert message("roles.actr_train.lr=1") == ("unknown key 'roles.actr_train'. Did you mean 'actor_train'? A role of "
                                                "your own needs a kind: one of train, infer, critic, env")
    assert message("roles.judge.kind=reward") == (
        "key 'roles.judge.kind': 'reward' is not a kind of role of your own; use one of train, infer, critic, env "
        "(rewards are roles.reward and roles.domain_rewards)")
    assert message("roles.teacher.kind=infer", "roles.teacher.modle_path=x") == (
        "unknown key 'roles.teacher.modle_path'. Did you mean 'model_path'?")
    assert message("roles.reference.kind=train").startswith("key 'roles.reference.kind': Input should be 'infer'")
    def checked(*overrides: str) -> str:  # a pipeline's own checks (config_problems) run with the plugins'
        with pytest.raises(ConfigError) as err:
            load_and_check(None, list(overrides))
        return str(err.value).removeprefix("config error in the default config: ")

    assert checked("pipeline=distill", "distill.teacher=actor_train") == (
        "key 'distill.teacher': roles.actor_train is a train role, not infer")
    assert checked("pipeline=distill", "roles.reference=null") == (
        "key 'distill.teacher': roles.reference is not configured; configured infer roles: actor_infer")
    assert checked("pipeline=agentic", "agentic.envs=[{env: frozen_lake, role: lake}]") == (
        "key 'agentic.envs[0].role': roles.lake is not configured; configured env roles: env")
    load_and_check(None, ["distill.teacher=actor_train"])  # rlvr does not read distill.*
    assert message("agentic.env_workers=2") == "unknown key 'agentic.env_workers'. It moved to 'roles.env.num_workers'."
    assert message("data.path=x.jsonl") == (  # nothing close: the section's keys, in the schema's order
        "unknown key 'data.path'. The keys of 'data': dataset, options, train_file, eval_file, eval_size, "
        "chat_template, apply_chat_template, domains, domain_interleave_probs.")
    assert message("bogus=1").startswith("unknown key 'bogus'. The keys of the config's top level: exp_name, ")
    # an env role of one's own ('env' is also a built-in role's name), and a check of a whole role of one's own
    assert message("roles.lake={kind: env, num_wrkers: 2}") == (
        "unknown key 'roles.lake.num_wrkers'. Did you mean 'num_workers'?")
    assert message("roles.teacher={kind: infer, device_mapping: [0, 0]}").startswith(
        "key 'roles.teacher': Value error, device_mapping lists devices [0] twice")
    # a check inside a section keeps its key; only whole-config checks print their message alone
    assert message("data.domains={a: {train_file: x, dataset: carry_addition}}").startswith(
        "key 'data.domains.a': Value error, give exactly one of dataset and train_file")


def test_config_files_that_cannot_be_read_are_named(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "none.yaml")
    assert str(err.value) == f"config error in {tmp_path / 'none.yaml'}: the file does not exist"
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert str(err.value).startswith(f"config error in {bad}: not valid YAML: ")
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert str(err.value) == f"config error in {bad}: the file must contain a mapping at the top level"
    bad.write_text("")
    assert load_config(bad) == load_config(None)


def test_overrides_parse_as_yaml_and_build_missing_levels():
    assert parse_override(" rollout.temperature =0.5") == (["rollout", "temperature"], 0.5)
    assert parse_override("a.b=") == (["a", "b"], None)
    assert parse_override("a=x=y") == (["a"], "x=y")
    for item in ("novalue", "=3", " =3"):
        with pytest.raises(ConfigError) as err:
            parse_override(item)
        assert str(err.value) == f"override '{item}' is not of the form key.sub=value"
    with pytest.raises(ConfigError) as err:
        parse_override("a=[1")
    assert str(err.value).startswith("override 'a=[1': value is not valid YAML (")
    assert apply_overrides({"a": 3, "b": {"c": 1}}, ["a.x=1", "b.d=2", "e.f.g=[1]"]) == {
        "a": {"x": 1}, "b": {"c": 1, "d": 2}, "e": {"f": {"g": [1]}}}


def test_reward_option_messages_name_the_reward_and_every_problem(roll_plugins):
    from roll_core.rewards import Reward
    from roll_core.testing import hooks

    class Graded(Reward):
        def __init__(self, threshold: float, rounds: int | None = None, *, mode: str = "all"):
            pass

        def score(self, sample):
            return 0.0

    class Plain(Reward):
        def score(self, sample):
            return 0.0

    class Open(Reward):
        def __init__(self, **anything):
            pass

        def score(self, sample):
            return 0.0

    def register(register):
        register("graded", Graded)
        register("plain", Plain)
        register("open", Open)

    roll_plugins(("t", hooks(roll_register_rewards=register)))
    assert error(None, ["roles.reward.name=graded", "roles.reward.options={thresold: 1, rounds: x}"]) == (
        "config error in the default config: key 'roles.reward.options' for reward 'graded': unknown option 'thresold'. Did you mean "
        "'threshold'? Valid options: threshold, rounds, mode; key 'roles.reward.options' for reward 'graded': "
        "missing required option(s) threshold; key 'roles.reward.options' for reward 'graded': option 'rounds' "
        "must be int, got 'x' (input should be a valid integer, unable to parse string as an integer)")
    assert error(None, ["roles.reward.name=plain", "roles.reward.options={b: 1, a: 2}"]) == (
        "config error in the default config: key 'roles.reward.options' for reward 'plain': it takes no options, got ['a', 'b']")
    cfg = load_and_check(None, ["roles.reward.name=open", "roles.reward.options={anything: 1}"])
    assert cfg.roles.reward.options == {"anything": 1}
    cfg = load_and_check(None, ["roles.reward.name=graded", "roles.reward.options={threshold: 1, mode: 3}"])
    assert cfg.roles.reward.options == {"threshold": 1.0, "mode": "3"}
    assert type(cfg.roles.reward.options["threshold"]) is float
    domain = error(None, ["data.domains={a: {dataset: carry_addition}}", "data.domain_interleave_probs={a: 1}",
                          "roles.domain_rewards={a: {rewards: [{name: plain}, {name: plain, options: {z: 1}}]}}"])
    assert domain == ("config error in the default config: key 'roles.domain_rewards.a.rewards[1].options' for reward 'plain': it takes "
                      "no options, got ['z']")


def test_an_agentic_runs_environments_and_their_options_are_checked_like_rewards(roll_plugins):
    """``roll validate`` names an unknown environment and options its constructor does not take, as
    the pipeline would once it builds one, for the ``env`` form and each entry of ``envs``; other
    pipelines do not read the section."""
    from roll_core.envs import Env
    from roll_core.testing import hooks

    class Lake(Env):
        def __init__(self, size: int = 4, slippery: bool = False):
            self.size = size

        def reset(self, seed=None):
            return "", {}

        def step(self, action):
            return "", 0.0, True, False, {}

    class Plain(Lake):
        __init__ = Env.__init__

    def register(register):
        register("lake", Lake)
        register("plain", Plain)

    roll_plugins(("t", hooks(roll_register_envs=register)), entry_points=False)  # these two alone
    agentic = ["pipeline=agentic", "agentic.env=lake"]
    assert error(None, agentic + ["agentic.env=lak"]) == (
        "config error in the default config: key 'agentic.env': unknown env 'lak'. Did you mean 'lake'? Valid names: "
        "lake, plain")
    assert error(None, agentic + ["agentic.env_options={sise: 5, size: many}"]) == (
        "config error in the default config: key 'agentic.env_options' for environment 'lake': unknown option "
        "'sise'. Did you mean 'size'? Valid options: size, slippery; key 'agentic.env_options' for environment "
        "'lake': option 'size' must be int, got 'many' (input should be a valid integer, unable to parse string as "
        "an integer)")
    assert error(None, ["pipeline=agentic", "agentic.envs=[{env: lake}, {env: plain, env_options: {size: 2}}, "
                                            "{env: lakes}]"]) == (
        "config error in the default config: key 'agentic.envs[2].env': unknown env 'lakes'. Did you mean 'lake'? "
        "Valid names: lake, plain; key 'agentic.envs[1].env_options' for environment 'plain': it takes no options, "
        "got ['size']")
    cfg = load_and_check(None, agentic + ["agentic.env_options={size: '5'}"])
    assert cfg.agentic.env_options == {"size": 5}  # a command line's string, as the constructor takes it
    load_and_check(None, ["agentic.env=nowhere"])  # the rlvr pipeline plays no environment


def test_an_options_model_registered_by_import_path_gets_the_same_checks(roll_plugins):
    from roll_core.testing import hooks

    def register(register):
        register("lazy_opts", "roll_core.algorithms.losses:vanilla_pg",
                 options="roll_core.config.schema:KLPenaltyConfig")  # any pydantic model, named by path

    roll_plugins(("t", hooks(roll_register_policy_losses=register)))
    assert error(None, ["algorithm.policy_loss=lazy_opts", "algorithm.policy_loss_options={coeff: 1}"]) == (
        "config error in the default config: key 'algorithm.policy_loss_options' for policy loss 'lazy_opts': unknown option 'coeff'. "
        "Did you mean 'coef'? Valid options: coef, estimator, adaptive, target_kl, horizon")


def test_a_strategy_registered_without_options_takes_none(plain_train_strategy):
    assert error(None, ["roles.actor_train.strategy=plain", "roles.actor_train.strategy_options={y: 2}"]) == (
        "config error in the default config: key 'roles.actor_train.strategy_options': train strategy 'plain' takes no "
        "options, got ['y']")


def test_strategy_options_are_checked_against_the_strategy_and_missing_plugins_are_named(roll_plugins):
    roll_plugins(entry_points=False)  # the built-in plugins only, as where no plugin package is installed
    assert error(None, ["roles.actor_infer.strategy_options={x: 1}"]) == (
        "config error in the default config: key 'roles.actor_infer.strategy_options' for infer strategy 'hf': unknown option "
        "'x'. Valid options: precision, cuda_graphs")
    assert "unknown option 'precison'. Did you mean 'precision'?" in error(
        None, ["roles.critic={strategy_options: {precison: bf16}}"])
    message = error(None, ["roles.actor_train.strategy=megatron"])
    assert message == ("config error in the default config: key 'roles.actor_train.strategy': unknown train strategy 'megatron'. Valid names: "
                       "fsdp2, hf. 'megatron' comes with the roll-megatron plugin: install it (plugins/roll_megatron)")
    assert "comes with" not in error(None, ["roles.actor_train.strategy=nope"])


def test_a_strategy_whose_engine_is_not_installed_is_rejected_with_its_install_hint(roll_plugins):
    from roll_core.testing import hooks

    def register(register):
        register("warp", "roll_core.strategies.hf:HFInferStrategy", kind="infer",
                 requires={"roll_no_such_engine": "pip install 'roll-warp[engine]'", "torch": "never shown"})

    roll_plugins(("t", hooks(roll_register_strategies=register)))
    assert error(None, ["roles.actor_infer.strategy=warp"]) == (
        "config error in the default config: key 'roles.actor_infer.strategy': infer strategy 'warp' needs the 'roll_no_such_engine' "
        "package, which is not installed: pip install 'roll-warp[engine]'")


class _EngineWithoutTopK:
    """An inference strategy written before ``top_k`` existed: its generate takes the older keywords only."""

    def generate(self, batch, *, max_new_tokens, temperature, top_p):
        raise AssertionError("validation must stop the run before any generate call")


def test_top_k_needs_a_generate_that_takes_it_and_is_not_sent_unless_it_cuts(roll_plugins):
    from roll_core.testing import hooks

    def register(register):
        register("older", _EngineWithoutTopK, kind="infer")

    roll_plugins(("t", hooks(roll_register_strategies=register)))
    assert error(None, ["roles.actor_infer.strategy=older", "rollout.top_k=50"]) == (
        "config error in the default config: key 'rollout.top_k': roles.actor_infer's infer strategy 'older' cannot "
        "sample with top-k (its generate() takes no top_k); set rollout.top_k=0, or use a strategy whose generate() "
        "takes it (roll's hf, vllm and sglang do)")
    teacher = ["pipeline=distill", "distill.responses=teacher", "roles.reference.strategy=older", "rollout.top_k=5"]
    assert "key 'rollout.top_k': roles.reference's infer strategy 'older'" in error(None, teacher)
    # the teacher is still checked when actor_infer's strategy is unknown (reported as such)
    both = error(None, [*teacher, "roles.actor_infer.strategy=nope"])
    assert "unknown infer strategy 'nope'" in both and "roles.reference's infer strategy 'older'" in both
    # a teacher generates only in the distill pipeline with responses: teacher
    load_and_check(None, ["distill.responses=teacher", "roles.reference.strategy=older", "rollout.top_k=5"])
    load_and_check(None, ["pipeline=distill", "roles.reference.strategy=older", "rollout.top_k=5"])
    cfg = load_and_check(None, ["roles.actor_infer.strategy=older"])  # top_k 0: the older keywords alone
    assert cfg.rollout.sampling() == {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0}
    cfg = load_and_check(None, ["rollout.top_k=50", "rollout.top_p=0.9", "rollout.temperature=0.7"])
    assert cfg.rollout.sampling(0.0) == {"max_new_tokens": 8, "temperature": 0.0, "top_p": 0.9, "top_k": 50}
    assert "rollout.top_k" in error(None, ["rollout.top_k=-1"])


def test_a_group_baseline_where_the_samples_of_a_group_cannot_differ_is_refused(roll_plugins):
    """``group_baseline=True`` estimators (grpo, rloo, gigpo, ...) compare a prompt's samples with
    each other: one sample a group, or greedy rlvr sampling (every sample the same), gives every
    advantage 0. Others (reinforce_plus_plus, gae) and the pipelines without an estimator are
    unaffected; a plugin's estimator declares it the same way."""
    from roll_core.testing import hooks

    refused = ("config error in the default config: key '{key}': '{name}' compares the samples of each prompt's "
               "group against each other, and a group of 1 makes every advantage 0; use 2 or more, or an estimator "
               "without a group baseline (reinforce_plus_plus)")
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        assert error(None, [f"algorithm.advantage_estimator={name}", "rollout.num_return_sequences=1"]) == \
            refused.format(key="rollout.num_return_sequences", name=name)
    for name in ("gigpo", "agentic_reinforce"):
        assert error(None, ["pipeline=agentic", f"algorithm.advantage_estimator={name}", "agentic.group_size=1"]) == \
            refused.format(key="agentic.group_size", name=name)
    load_and_check(None, ["algorithm.advantage_estimator=reinforce_plus_plus", "rollout.num_return_sequences=1"])
    load_and_check(None, ["pipeline=agentic", "algorithm.advantage_estimator=step_reinforce", "agentic.group_size=1"])
    load_and_check(None, ["pipeline=sft", "rollout.num_return_sequences=1"])  # sft trains on demonstrations
    load_and_check(None, ["rollout.num_return_sequences=2"])  # the least group that compares
    assert error(None, ["rollout.temperature=0"]) == (
        "config error in the default config: key 'rollout.temperature': 0 samples greedily, so every response of a "
        "prompt's group is the same and 'grpo' gives each an advantage of 0; sample with a temperature above 0")
    load_and_check(None, ["rollout.temperature=0", "algorithm.advantage_estimator=reinforce_plus_plus"])
    load_and_check(None, ["pipeline=agentic", "rollout.temperature=0"])  # the environment may still tell episodes apart

    def register(register):
        register("pairwise", "roll_core.algorithms.advantages:rloo", group_baseline=True)

    roll_plugins(("t", hooks(roll_register_advantage_estimators=register)))
    assert error(None, ["algorithm.advantage_estimator=pairwise", "rollout.num_return_sequences=1"]).startswith(
        "config error in the default config: key 'rollout.num_return_sequences': 'pairwise' compares")


def test_a_tracker_listed_twice_is_refused():
    assert error(None, ["trackers=[jsonl, stdout, jsonl]"]) == (
        "config error in the default config (with command-line overrides): trackers lists jsonl more than once; "
        "each would log every step again")
    assert load_config(None, ["trackers=[jsonl, stdout]"]).trackers == ["jsonl", "stdout"]


def test_a_preference_loss_gets_its_own_options_and_a_reference_where_it_reads_one():
    assert error(None, ["pipeline=dpo", "dpo.loss=simpo", "dpo.loss_options={gama: 1}"]) == (
        "config error in the default config: key 'dpo.loss_options' for preference loss 'simpo': unknown option "
        "'gama'. Did you mean 'gamma'? Valid options: gamma")
    assert "preference loss 'dpo_sigmoid': unknown option 'gamma'. Valid options: (none)" in error(
        None, ["pipeline=dpo", "dpo.loss_options={gamma: 1}"])
    assert error(None, ["pipeline=dpo", "roles.reference=null"]) == (
        "config error in the default config: key 'dpo.reference': 'role' needs roles.reference, which is null, for "
        "preference loss 'dpo_sigmoid' (add roles.reference={}, or set dpo.reference=precomputed)")
    assert error(None, ["pipeline=online_dpo", "roles.reference=null", "dpo.loss=ipo"]).endswith(
        "for preference loss 'ipo' (add roles.reference={}, or a reference-free loss: simpo)")
    for fine in (["pipeline=dpo", "roles.reference=null", "dpo.reference=precomputed"],
                 ["pipeline=online_dpo", "roles.reference=null", "dpo.loss=simpo", "dpo.loss_options={gamma: 1}"],
                 ["pipeline=sft", "roles.reference=null"]):
        load_and_check(None, fine)
