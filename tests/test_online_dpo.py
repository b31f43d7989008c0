"""The ``online_dpo`` pipeline on the tiny model: the pairs it trains on, its reference, and that it
learns the embedded task. The pair rule itself is in ``test_preference.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import metrics_of

from roll_core.runtime import LocalExecutor


def run_online_dpo(tiny_config, *overrides):
    from roll_core.pipelines.online_dpo import OnlineDPOPipeline

    cfg = tiny_config("pipeline=online_dpo", *overrides)
    return cfg, OnlineDPOPipeline(cfg, LocalExecutor()).run()


def test_online_dpo_trains_each_groups_best_over_its_worst_and_raises_heldout_accuracy(tiny_config):
    # sampling at 0.7 while DPO reads log-probs at 1: a reference pass at the sampling temperature
    # would show as a margin at step 1. The weights travel to actor_infer as copies (object_store):
    # under in_process both roles compute with the same tensors, and a missed push would not show.
    # The difficulty mask pairs only prompts answered right less than 3/4 of the time.
    cfg, summary = run_online_dpo(tiny_config, "warmup.steps=500", "rollout.prompts_per_step=32",
                                  "rollout.num_return_sequences=8", "rollout.temperature=0.7",
                                  "roles.actor_train.micro_batch_size=64", "trainer.max_steps=30",
                                  "data.eval_size=200", "trainer.dump_rollouts_every=1",
                                  "runtime.weight_sync=object_store", "algorithm.difficulty_mask={low: 0, high: 0.75}")
    from roll_core.pipelines.rollout_dump import load_dump

    pairs = load_dump(cfg.output_dir, 1)
    rows = [r for r in metrics_of(cfg.output_dir) if r["step"] > 0]
    assert rows[0]["online_dpo/pairs"] == len(pairs) / 2 > 0
    assert rows[0]["online_dpo/unpaired_groups"] == pytest.approx(1 - len(pairs) / 2 / 32)
    chosen = pairs["chosen"]
    assert chosen.tolist() == [True, False] * (len(pairs) // 2)
    assert pairs["pair"].tolist() == [i // 2 for i in range(len(pairs))]
    assert (pairs["scores"][chosen] > pairs["scores"][~chosen]).all()
    assert pairs["prompt"][0::2] == pairs["prompt"][1::2]  # both sides answer one prompt
    assert len(set(pairs["prompt"][0::2])) == len(pairs) // 2  # one pair per prompt
    # the reference is the policy RL starts from: before the first update every log-ratio is 0
    assert rows[0]["dpo/rewards/margin"] == pytest.approx(0.0, abs=1e-6)
    assert rows[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert torch.isfinite(pairs["reference_logp"]).all() and (pairs["reference_logp"] < 0).all()
    assert all(r["online_dpo/pairs"] > 0 and "dpo/grad_norm" in r for r in rows)
    # a group is masked whole (its mean score 0, 1 or at least 3/4) or, being mixed, paired
    assert all(r["online_dpo/pairs"] + r["shaping/masked_samples"] / 8 == 32 for r in rows)
    assert sum(r["shaping/masked_samples"] for r in rows) > 0
    assert abs(rows[-1]["dpo/rewards/margin"]) > 1e-3  # the policy has moved away from the reference
    before, after = summary["before_rl"]["eval/accuracy"], summary["after_rl"]["eval/accuracy"]
    assert after > before + 0.1, summary
    # exported, the pairs of a step are those it trained on
    from roll_core.pipelines.rollout_dump import export_pairs

    count, steps = export_pairs(cfg.output_dir, Path(cfg.output_dir) / "pairs.jsonl", (1, 1))
    exported = [json.loads(line) for line in (Path(cfg.output_dir) / "pairs.jsonl").read_text().splitlines()]
    assert count == len(pairs) // 2 and steps == [1]
    assert [(r["prompt"], r["chosen"], r["rejected"], r["chosen_score"]) for r in exported] == [
        (pairs["prompt"][i], pairs["response_text"][i], pairs["response_text"][i + 1], float(pairs["scores"][i]))
        for i in range(0, len(pairs), 2)]


def test_a_reference_free_loss_trains_without_a_reference_role(tiny_config):
    cfg, _ = run_online_dpo(tiny_config, "warmup.steps=120", "trainer.max_steps=1", "trainer.dump_rollouts_every=1",
                            "rollout.prompts_per_step=16", "rollout.num_return_sequences=8", "dpo.loss=simpo",
                            "dpo.beta=2", "roles.reference=null")
    from roll_core.pipelines.rollout_dump import load_dump

    pairs = load_dump(cfg.output_dir, 1)
    assert len(pairs) and pairs["reference_logp"].tolist() == [0.0] * len(pairs)


@pytest.mark.parametrize("override, message", [
    ("rollout.num_return_sequences=1", "num_return_sequences.: online_dpo pairs samples of one prompt, so it must "
                                       "be at least 2"),
    ("rollout.temperature=0", "0 samples greedily, so every answer to a prompt is the same and online_dpo finds no "
                              "pair"),
    ("dpo.reference=precomputed", "no log-probs can be precomputed"),
    ("roles.critic={}", "trains no critic"),
    ("roles.actor_train.micro_batch_size=3", "online_dpo keeps each pair in one micro-batch"),
    ("algorithm.kl_loss_coef=0.1", r"config error in the config: key 'algorithm.kl_loss_coef': online_dpo's update "
                                   r"is the preference loss .* rlvr's algorithm.kl_loss_coef does not apply"),
    ("algorithm.ppo_epochs=2", "rlvr's algorithm.ppo_epochs does not apply"),
    ("algorithm.reward_clip=1.0", "rlvr's algorithm.reward_clip does not apply"),
    ("algorithm.advantage_estimator=rloo", "rlvr's algorithm.advantage_estimator does not apply"),
])
def test_online_dpo_refuses_what_it_cannot_train_before_any_worker(tiny_config, override, message):
    from roll_core.config import check_registry_names
    from roll_core.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        check_registry_names(tiny_config("pipeline=online_dpo", override))


def test_online_dpo_reports_every_problem_at_once_and_checks_a_pipeline_built_in_python(tiny_config):
    from roll_core.config import check_registry_names
    from roll_core.errors import ConfigError
    from roll_core.pipelines.online_dpo import OnlineDPOPipeline

    cfg = tiny_config("pipeline=online_dpo", "rollout.num_return_sequences=1", "roles.critic={}")
    with pytest.raises(ConfigError) as err:
        OnlineDPOPipeline(cfg, LocalExecutor()).run()  # no loader: the pipeline checks before any worker
    assert "key 'rollout.num_return_sequences'" in str(err.value) and "key 'roles.critic'" in str(err.value)
    assert not (Path(cfg.output_dir) / "config.json").exists()
    check_registry_names(tiny_config("pipeline=online_dpo", "algorithm.max_length_mask=true",  # what it reads
                                     "algorithm.max_grad_norm=0.5", "algorithm.difficulty_mask={low: 0, high: 1}"))
