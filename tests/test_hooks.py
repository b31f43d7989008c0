"""One test per hook: a plugin implementing it registers something that the registry then serves."""

import pytest

from roll_core.envs import Env
from roll_core.rewards import Reward, RewardInput
from roll_core.testing import hooks


def test_roll_register_strategies(roll_plugins):
    def roll_register_strategies(register):
        register("mine", "roll_core.strategies.hf:HFTrainStrategy", kind="train")
        register("mine", "roll_core.strategies.hf:HFInferStrategy", kind="infer")

    p = roll_plugins(("t", hooks(roll_register_strategies=roll_register_strategies)))
    assert p.train_strategies.get("mine").__name__ == "HFTrainStrategy"
    assert p.infer_strategies.get("mine").__name__ == "HFInferStrategy"
    assert p.plugins["t"].provides == {"train_strategies": ["mine"], "infer_strategies": ["mine"]}


def test_roll_register_strategies_rejects_unknown_kind(roll_plugins):
    def roll_register_strategies(register):
        register("x", "a:b", kind="trian")

    p = roll_plugins(("t", hooks(roll_register_strategies=roll_register_strategies)))
    assert p.plugins["t"].status == "broken" and "kind must be one of" in p.plugins["t"].error


def test_roll_register_advantage_estimators(roll_plugins):
    def double(batch, config):
        return batch * 2, batch

    p = roll_plugins(("t", hooks(roll_register_advantage_estimators=lambda register: register("double", double))))
    assert p.advantage_estimators.get("double") is double


def test_roll_register_policy_losses(roll_plugins):
    def zero(inputs, config):
        return 0, {}

    p = roll_plugins(("t", hooks(roll_register_policy_losses=lambda register: register("zero", zero))))
    assert p.policy_losses.get("zero") is zero and "ppo_clip" in p.policy_losses


def test_roll_register_kl_estimators(roll_plugins):
    def halved(lp, ref):
        return 0.5 * (lp - ref).abs()

    p = roll_plugins(("t", hooks(roll_register_kl_estimators=lambda register: register("halved", halved))))
    assert p.kl_estimators.get("halved") is halved


def test_roll_register_preference_losses(roll_plugins):
    def hinge(inputs, *, beta, label_smoothing=0.0):
        return (1 - beta * inputs.policy_chosen).clamp(min=0), {}

    p = roll_plugins(("t", hooks(roll_register_preference_losses=lambda register: register("hinge", hinge))))
    assert p.preference_losses.get("hinge") is hinge and "dpo_sigmoid" in p.preference_losses


def test_roll_register_distill_losses(roll_plugins):
    def total_variation(student_logp, teacher_logp):
        return 0.5 * (student_logp.exp() - teacher_logp.exp()).abs().sum(-1)

    p = roll_plugins(("t", hooks(roll_register_distill_losses=lambda register: register("tv", total_variation))))
    assert p.distill_losses.get("tv") is total_variation and "jsd" in p.distill_losses


def test_roll_register_datasets(roll_plugins):
    class Two:
        def __init__(self, options):
            self.options = options

        def train_rows(self):
            return [{"prompt": "1+1=", "ground_truth": "2"}]

        def eval_rows(self):
            return []

    p = roll_plugins(("t", hooks(roll_register_datasets=lambda register: register("two", Two))))
    assert p.datasets.get("two")({}).train_rows()[0]["ground_truth"] == "2"


def test_roll_register_rewards(roll_plugins):
    class Length(Reward):
        def score(self, sample):
            return len(sample.response)

    p = roll_plugins(("t", hooks(roll_register_rewards=lambda register: register("length", Length))))
    assert p.rewards.get("length")().score(RewardInput("p", "abc", None)) == 3


def test_roll_register_envs(roll_plugins):
    class Counter(Env):
        def reset(self, seed=None):
            self.n = 0
            return "0", {}

        def step(self, action):
            self.n += 1
            return str(self.n), float(action == "up"), self.n >= 2, False, {}

    p = roll_plugins(("t", hooks(roll_register_envs=lambda register: register("counter", Counter))))
    env = p.envs.get("counter")()
    assert env.reset() == ("0", {})
    assert env.step("up")[:3] == ("1", 1.0, False)
    assert env.step("down")[2] is True


def test_roll_register_schedulers(roll_plugins):
    p = roll_plugins(("t", hooks(roll_register_schedulers=lambda register: register(
        "sync2", "roll_core.rollout.sync:SyncRolloutScheduler"))))
    assert p.schedulers.get("sync2") is p.schedulers.get("sync")


def test_roll_register_schedulers_metadata_says_whether_it_overlaps_training(roll_plugins):
    from roll_core.rollout import overlaps_training

    p = roll_plugins(("t", hooks(roll_register_schedulers=lambda register: register(
        "ahead", "roll_core.rollout.async_scheduler:AsyncRolloutScheduler", overlaps_training=True))))
    assert overlaps_training("ahead", p) and overlaps_training("async", p)
    assert not overlaps_training("sync", p)


def test_roll_register_weight_syncs(roll_plugins):
    from roll_core.runtime.weight_sync import ObjectStoreSync, WeightSync

    class Pigeon(ObjectStoreSync):
        pass

    p = roll_plugins(("t", hooks(roll_register_weight_syncs=lambda register: register("pigeon", Pigeon))))
    assert issubclass(p.weight_syncs.get("pigeon"), WeightSync)
    assert set(p.weight_syncs.names()) == {"collective", "in_process", "object_store", "pigeon", "shared_memory"}


def test_roll_register_trackers(roll_plugins, tmp_path):
    from roll_core.trackers import Tracker

    logged = []

    class ListTracker(Tracker):
        def log(self, metrics, step):
            logged.append((step, metrics))

    p = roll_plugins(("t", hooks(roll_register_trackers=lambda register: register("list", ListTracker))))
    p.trackers.get("list")(tmp_path).log({"a": 1.0}, 3)
    assert logged == [(3, {"a": 1.0})]


def test_roll_register_pipelines(roll_plugins):
    from roll_core.pipelines import Pipeline

    class Echo(Pipeline):
        def run(self):
            return {"config": self.config}

    p = roll_plugins(("t", hooks(roll_register_pipelines=lambda register: register("echo", Echo))))
    assert p.pipelines.get("echo")("cfg", None).run() == {"config": "cfg"}


def test_a_registered_pipeline_checks_its_own_config_where_the_built_in_ones_do(roll_plugins):
    from roll_core.config import load_and_check
    from roll_core.errors import ConfigError
    from roll_core.pipelines import Pipeline

    class Pairs(Pipeline):
        reads_eval_reward = True

        @classmethod
        def config_problems(cls, cfg, plugins):
            n = cfg.rollout.num_return_sequences
            return super().config_problems(cfg, plugins) + ([f"key 'rollout.num_return_sequences': pairs need 2, "
                                                             f"got {n}"] if n != 2 else [])

        def run(self):
            return {}

    p = roll_plugins(("t", hooks(roll_register_pipelines=lambda register: register("pairs", Pairs))))
    with pytest.raises(ConfigError, match="key 'rollout.num_return_sequences': pairs need 2, got 8"):
        load_and_check(None, ["pipeline=pairs"], plugins=p)
    load_and_check(None, ["pipeline=pairs", "rollout.num_return_sequences=2", "roles.eval_reward={}"], plugins=p)
    Pairs.reads_eval_reward = False  # the default: a set eval_reward that no one would read is refused
    with pytest.raises(ConfigError, match="key 'roles.eval_reward': pipeline pairs evaluates without a reward"):
        load_and_check(None, ["pipeline=pairs", "rollout.num_return_sequences=2", "roles.eval_reward={}"], plugins=p)


def test_a_registered_pipeline_answers_for_its_environments_overlap_and_task(roll_plugins):
    """What the loader, placement and run line used to know only of the built-in pipelines by name,
    a third-party pipeline says for itself."""
    from roll_core.config import load_and_check, load_config
    from roll_core.errors import ConfigError
    from roll_core.pipelines import Pipeline
    from roll_core.config.schema import EnvSettings
    from roll_core.launch import describe_run
    from roll_core.runtime.placement import controller_blocker, generates_while_training

    class Arena(Pipeline):
        overlap_setting = "arena.live: true"

        @classmethod
        def environments(cls, cfg):
            return [EnvSettings("arena", "no_such_env", "arena", {}, "env", 1, 1, 4, "")]

        @classmethod
        def generates_while_training(cls, cfg, plugins):
            return "the arena plays on" if cfg.seed == 7 else None

        @classmethod
        def describe_task(cls, cfg):
            return "matches in the arena"

        def run(self):
            return {}

    p = roll_plugins(("t", hooks(roll_register_pipelines=lambda register: register("arena", Arena))))
    with pytest.raises(ConfigError) as err:
        load_and_check(None, ["pipeline=arena", "rollout.async_generation_ratio=1"], plugins=p)
    assert "key 'arena.env': " in str(err.value) and "'no_such_env'" in str(err.value)  # its envs are checked
    assert "needs arena.live: true (or set it to 0)" in str(err.value)
    cfg = load_config(None, ["pipeline=arena", "seed=7", "executor=ray"])
    assert generates_while_training(cfg) == "the arena plays on"
    assert controller_blocker(cfg) == "the arena pipeline's environment workers run in processes of their own"
    assert "pipeline arena, model tiny, matches in the arena, executor ray" in describe_run(cfg)
    assert "pipeline rlvr, model tiny, data carry_addition, reward " in describe_run(load_config(None, []))
    judged = describe_run(load_config(None, ["roles.eval_reward={name: math_verify}"]))
    assert "reward exact_match, evaluated by math_verify, executor" in judged
    assert Pipeline.generates_while_training(load_config(None, ["rollout.scheduler=nope"]), p) is None  # reported


def test_a_registered_class_of_the_run_shape_only_answers_with_the_pipeline_defaults(roll_plugins):
    from roll_core.config import load_config
    from roll_core.pipelines import Pipeline, pipeline_class

    class Bare:  # cls(config, executor).run(), nothing more
        def __init__(self, config, executor):
            pass

        def run(self):
            return {}

    p = roll_plugins(("t", hooks(roll_register_pipelines=lambda register: register("bare", Bare))))
    assert pipeline_class(load_config(None, ["pipeline=bare"]), p) is Pipeline
    assert pipeline_class(load_config(None, ["pipeline=unknown"]), p) is Pipeline
    assert pipeline_class(load_config(None, []), p).__name__ == "RLVRPipeline"


def test_hook_implementations_may_take_no_arguments(roll_plugins):
    """Opt-in arguments: an implementation that accepts none of the hook's arguments still runs."""
    called = []
    p = roll_plugins(("t", hooks(roll_register_rewards=lambda: called.append(True))))
    assert called == [True] and p.plugins["t"].status == "ok"


@pytest.mark.parametrize("hook", ["roll_register_rewards", "roll_register_envs"])
def test_hook_raising_marks_plugin_broken_and_withdraws_registrations(roll_plugins, hook):
    def impl(register):
        register("half_done", "a:b")
        raise RuntimeError("boom")

    p = roll_plugins(("bad", hooks(**{hook: impl})))
    assert p.plugins["bad"].status == "broken"
    assert "RuntimeError: boom" in p.plugins["bad"].error
    assert "half_done" not in p.rewards and "half_done" not in p.envs
    assert "exact_match" in p.rewards  # the others keep working
