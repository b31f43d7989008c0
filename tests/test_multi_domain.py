"""Multi-domain RLVR: the domain mix of every step, per-domain reward workers, config errors that
name the domain, and a two-domain run on the tiny model (arithmetic scored by exact match, a
code-style task scored by running the model's program in roll-rewards' sandbox)."""

from __future__ import annotations

import pytest

from conftest import metrics_of

from roll_core.config import load_and_check
from roll_core.errors import ConfigError
from roll_core.rewards import Reward, RewardInput
from roll_core.rollout.rewards import RewardRouter
from roll_core.runtime.executor import LocalExecutor
from roll_core.runtime.reward_worker import RewardWorker
from roll_core.testing import hooks


def _rows(domain, n):
    return [{"prompt": f"{domain}{i}", "ground_truth": "x", "domain": domain} for i in range(n)]


@pytest.mark.parametrize("overrides, message", [
    (["data.domain_interleave_probs={a: 0.7, b: 0.7}"], "must be non-negative and sum to 1"),
    (["data.domains={a: {dataset: carry_addition}}", "data.domain_interleave_probs={a: 0.5, b: 0.5}"],
     "unknown \\['b'\\]"),
    (["data.domains={a: {dataset: carry_addition, train_file: x.jsonl}}"], "exactly one of dataset and train_file"),
    (["roles.domain_rewards={code: {rewards: [{name: exact_mach}]}}"],
     "roles.domain_rewards.code.rewards\\[0\\].name': unknown reward 'exact_mach'. Did you mean 'exact_match'"),
    (["roles.domain_rewards={code: {rewards: [{name: exact_match, options: {strp: true}}]}}"],
     "roles.domain_rewards.code.rewards\\[0\\].options' for reward 'exact_match': unknown option 'strp'"),
    (["data.domains={a: {dataset: carry_adition}}"], "data.domains.a.dataset': unknown dataset 'carry_adition'"),
    (["roles.domain_rewards={code: {rewards: []}}"], "rewards"),
])
def test_config_errors_name_the_domain_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_and_check(None, overrides)


class _Const(Reward):
    def __init__(self, value: float = 1.0):
        self.value = value

    def score(self, sample):
        return self.value


def test_router_sends_each_domain_to_its_workers_with_weights(roll_plugins):
    roll_plugins(("consts", hooks(
        roll_register_rewards=lambda register: register("const", _Const))))
    ex = LocalExecutor()
    default = ex.spawn("reward", RewardWorker, [([("const", {"value": 1.0}, 1.0)], None)])
    code = ex.spawn("reward/code", RewardWorker,
                    [([("const", {"value": 2.0}, 0.5), ("exact_match", {}, 3.0)], None) for _ in range(2)])
    router = RewardRouter(default, {"code": code})
    samples = [RewardInput("p", "x", "x", "code"), RewardInput("p", "x", "y", "math"),
               RewardInput("p", "x", "y", "code"), RewardInput("p", "x", "x", "default")]
    scores, components, seconds = router.gather(router.submit(samples))
    # code: 0.5 * 2 + 3 * exact_match; everything else: the default reward.
    assert scores == [4.0, 1.0, 1.0, 1.0]
    assert components[0] == {"const": 2.0, "exact_match": 1.0} and components[1] == {"const": 1.0}
    assert seconds >= 0


@pytest.mark.ray
def test_two_domain_run_reports_per_domain_metrics(tiny_config):
    """Must-show: arithmetic (exact match, scored in the driver) and python_expr (programs run in
    the sandbox, on two Ray reward workers), half of every step from each, metrics per domain."""
    pytest.importorskip("roll_rewards")
    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.runtime import make_executor

    cfg = tiny_config(
        "executor=ray", "torch_threads=1", "trainer.max_steps=2", "warmup.steps=30", "data.eval_size=6",
        "rollout.max_new_tokens=20", "rollout.request_size=4",
        "data.domains={arithmetic: {dataset: carry_addition}, code: {dataset: python_expr}}",
        "data.domain_interleave_probs={arithmetic: 0.5, code: 0.5}",
        "roles.domain_rewards={code: {rewards: [{name: code, options: {wall_seconds: 5}}], num_workers: 2}}",
    )
    executor = make_executor(cfg)
    try:
        pipeline = RLVRPipeline(cfg, executor)
        summary = pipeline.run()
        assert [g.role for g in pipeline.reward.groups()] == ["reward", "reward/code"]
        assert len(pipeline.reward.by_domain["code"]) == 2
        # exact_match scores in the driver, the sandboxed code reward on its Ray workers: one router
        assert pipeline.reward.default.executor.name == "local"
        assert pipeline.reward.by_domain["code"].executor is executor
    finally:
        executor.shutdown()
    rows = metrics_of(cfg.output_dir)
    for step in rows[1:]:
        assert step["samples/arithmetic"] == step["samples/code"] == 8  # 2 + 2 prompts x 4 samples
        for d in ("arithmetic", "code"):
            assert 0.0 <= step[f"reward/{d}/mean"] <= 1.0
            assert step[f"response_length/{d}/mean"] > 0
        assert step["time/generate_s"] > 0 and step["time/reward_s"] > 0
    assert {"eval/accuracy/arithmetic", "eval/accuracy/code"} <= set(summary["after_rl"])
    assert rows[-1]["data/epoch"] == 0


def test_python_expr_ground_truth_runs_in_the_code_reward():
    pytest.importorskip("roll_rewards")
    from roll_core.embedded.tasks import PythonExprTask
    from roll_rewards.code import CodeReward

    task = PythonExprTask()
    row = task.eval_rows()[0]
    a, b = row["prompt"].rstrip(":").split("x+")
    reward = CodeReward(partial=False)
    good = RewardInput(row["prompt"], f"f=lambda x:{a}*x+{b}", row["ground_truth"], "code")
    sloppy = RewardInput(row["prompt"], f"f=lambda x:{a}x+{b}", row["ground_truth"], "code")
    swapped = RewardInput(row["prompt"], f"f=lambda x:{b}+x*{a}", row["ground_truth"], "code")
    assert [reward.score(s) for s in (good, sloppy, swapped)] == [1.0, 0.0, 1.0]
    demos = [r["demonstration"] for r in task.train_rows()]
    sloppy_share = sum("*" not in d for d in demos) / len(demos)
    assert 0.75 < sloppy_share < 0.85  # teacher_syntax_error = 0.8
