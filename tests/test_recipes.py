"""Every recipe in examples/recipes/ and every registered estimator / loss / KL estimator runs real
RLVR steps on the embedded tiny model (local executor), and PPO's value loss falls."""

import json
import math
from pathlib import Path

import pytest

from conftest import metrics_of

from roll_core.config import load_config
from roll_core.pipelines.rlvr import RLVRPipeline
from roll_core.runtime import LocalExecutor

RECIPES = sorted((Path(__file__).parents[1] / "examples" / "recipes").glob("*.yaml"))
FAST = ["executor=local", "warmup.steps=5", "rollout.prompts_per_step=4", "rollout.num_return_sequences=4",
        "trainer.max_steps=2", "trainer.eval_every=0", "trainer.save_every=0", "data.eval_size=8",
        "trackers=[jsonl]"]


def run(path, tmp_path, *overrides):
    cfg = load_config(path, FAST + [f"output_dir={tmp_path / 'run'}", *overrides])
    RLVRPipeline(cfg, LocalExecutor()).run()
    rows = metrics_of(tmp_path / "run")
    for row in rows[1:]:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
    return rows


def test_there_is_a_recipe_and_a_docs_page_for_each_named_algorithm():
    names = {p.stem for p in RECIPES}
    assert names == {"ppo", "grpo", "reinforce_plus_plus", "rloo", "raft_plus_plus", "gspo", "topr", "lite_ppo",
                     "dr_grpo", "dapo", "cispo"}
    docs = Path(__file__).parents[1] / "docs" / "recipes"
    for name in names:
        page = (docs / f"{name}.md").read_text()
        assert f"examples/recipes/{name}.yaml" in page, name


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_runs_a_few_steps(recipe, tmp_path):
    # 16 samples per step in the fast config: a mini-batch of 8 gives two optimizer steps
    extra = ["algorithm.ppo_mini_batch_size=8"] if recipe.stem == "ppo" else []
    rows = run(recipe, tmp_path, *extra)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 and "train/pg_loss" in r for r in rows[1:])


def test_ppo_value_loss_falls(tmp_path):
    rows = run(RECIPES[0].with_name("ppo.yaml"), tmp_path, "trainer.max_steps=5", "algorithm.ppo_mini_batch_size=16")
    losses = [r["critic/value_loss"] for r in rows[1:]]
    assert losses[-1] < 0.5 * losses[0], losses


def test_dynamic_sampling_reports_its_rounds(tmp_path):
    rows = run(RECIPES[0].with_name("dapo.yaml"), tmp_path)
    for r in rows[1:]:
        assert 1 <= r["rollout/sampling_rounds"] <= 4
        assert r["rollout/kept_groups"] + r["rollout/fallback_groups"] == 4


@pytest.mark.parametrize("overrides", [
    ["algorithm.policy_loss=dual_clip"],
    ["algorithm.policy_loss=tis"],
    ["algorithm.policy_loss=kimi"],
    ["algorithm.policy_loss=vanilla_pg"],
    ["algorithm.advantage_estimator=reinforce_plus_plus_baseline"],
    ["algorithm.advantage_estimator=step_reinforce"],
    ["algorithm.advantage_estimator=agentic_reinforce"],
    ["algorithm.advantage_estimator=gigpo"],
    ["algorithm.kl_loss_coef=0.01", "algorithm.kl_estimator=full"],
    ["algorithm.kl_penalty.coef=0.01", "algorithm.kl_penalty.estimator=full", "algorithm.kl_penalty.adaptive=true"],
    ["algorithm.kl_loss_coef=0.01", "algorithm.kl_estimator=abs", "algorithm.difficulty_mask.low=0.0"],
], ids=lambda o: " ".join(x.split(".", 1)[1] for x in o))
def test_every_registered_piece_runs_in_the_pipeline(overrides, tmp_path):
    rows = run(None, tmp_path, *overrides)
    assert len(rows) == 3


def test_on_policy_distillation_from_a_teacher_reference(tmp_path, tiny_model_path):
    # the teacher is a different model than the student's starting point (the warmed-up one)
    rows = run(None, tmp_path, "algorithm.advantage_estimator=opd", f"roles.reference.model_path={tiny_model_path}")
    assert rows[1]["advantage/abs_mean"] > 0


def test_estimators_that_need_a_role_are_rejected_before_anything_starts():
    from roll_core.config.loader import check_registry_names
    from roll_core.errors import ConfigError

    with pytest.raises(ConfigError, match="'gae' needs roles.critic"):
        check_registry_names(load_config(None, ["algorithm.advantage_estimator=gae"]))
    with pytest.raises(ConfigError, match="'opd' needs roles.reference"):
        check_registry_names(load_config(None, ["algorithm.advantage_estimator=opd", "roles.reference=null"]))


def test_ppo_resumes_with_its_critic_and_shaping_state(tmp_path):
    ppo = RECIPES[0].with_name("ppo.yaml")
    adaptive = ["algorithm.ppo_mini_batch_size=16", "algorithm.kl_penalty.adaptive=true",
                "algorithm.reward_norm.mean=running"]
    run(ppo, tmp_path, *adaptive)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    assert (ckpt / "critic" / "model" / "config.json").exists()
    state = json.loads((ckpt / "state.json").read_text())
    assert state["shaping"]["running"][0] == 2 * 16 and state["shaping"]["kl_coef"] > 0
    rows = run(ppo, tmp_path, *adaptive, "trainer.max_steps=3")
    assert rows[-1]["step"] == 3 and "critic/value_loss" in rows[-1]
