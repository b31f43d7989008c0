"""The ``reward_model`` pipeline: a critic learns Bradley-Terry scores from pairs, resumes like every
run, and is exported as a sequence classifier that scores as it was trained."""

from __future__ import annotations

import math

import pytest
import torch

from roll_core.algorithms.objective import RewardModelObjective, last_response_values
from roll_core.config import load_config
from roll_core.data import Batch
from roll_core.trackers import read_metrics

RUN = ["pipeline=reward_model", "roles.critic={lr: 3.0e-4}", "executor=local", "data.eval_size=100",
       "trainer.eval_every=0", "trackers=[jsonl]"]


def test_a_responses_score_is_its_value_at_the_last_response_token():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    # the third row has no response token: the value before it, at index 0, is all there is
    assert last_response_values(values, mask).tolist() == [2.0, 6.0, 7.0]


def test_the_objective_averages_bradley_terry_over_the_step_s_pairs():
    values = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [2.0, 0.0]])  # scores 1, 0, 0 and 2
    micro = Batch({"response_mask": torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]]),
                   "pair": torch.tensor([0, 0, 1, 1]), "chosen": torch.tensor([True, False, True, False])})
    loss, metrics = RewardModelObjective()({"values": values}, micro, 0.0, 8.0)  # 8 rows: 4 pairs in the step
    assert float(loss) == pytest.approx((math.log1p(math.exp(-1)) + math.log1p(math.exp(2))) / 4, abs=1e-6)
    assert metrics["reward_model/rewards/margin"] == pytest.approx(-0.5)
    assert metrics["reward_model/rewards/accuracy"] == 0.5
    half = Batch({**micro.tensors, "pair": torch.tensor([0, 0, 1, 2])})
    with pytest.raises(ValueError, match="a micro-batch holds half of a preference pair"):
        RewardModelObjective()({"values": values}, half, 0.0, 8.0)


@pytest.mark.parametrize("overrides, message", [
    ([], "pipeline reward_model trains roles.critic (the model with a score head), which is not configured: add "
         "roles.critic={}"),
    (["roles.critic={micro_batch_size: 3}"], "key 'roles.critic.micro_batch_size': reward_model keeps each pair in "
                                             "one micro-batch, so it must be even, got 3"),
    (["roles.critic={}", "roles.eval_reward={}"], "key 'roles.eval_reward': pipeline reward_model evaluates without "
                                                  "a reward"),
])
def test_what_the_pipeline_cannot_train_is_a_config_error(overrides, message):
    from roll_core.config import load_and_check
    from roll_core.errors import ConfigError

    load_config(None, ["pipeline=reward_model", *overrides])  # the schema holds for every pipeline
    with pytest.raises(ConfigError) as err:
        load_and_check(None, ["pipeline=reward_model", *overrides])  # the pipeline's own checks
    assert message in str(err.value)


def test_every_problem_of_a_reward_model_config_is_reported_at_once():
    from roll_core.config import load_and_check
    from roll_core.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_and_check(None, ["pipeline=reward_model", "roles.eval_reward={}"])
    assert "key 'roles.eval_reward'" in str(err.value) and "key 'roles.critic'" in str(err.value)


def scores_of(model_dir, tokenizer, texts: list[str]) -> list[float]:
    """A sequence classifier's score of each text alone, as transformers reads it."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [float(model(input_ids=torch.tensor([tokenizer(t)["input_ids"]])).logits[0, 0]) for t in texts]


def test_the_reward_model_learns_the_pairs_resumes_exactly_and_exports_what_it_learned(tmp_path):
    import roll_core
    from roll_core.pipelines.dpo import preference_pairs
    from roll_core.pipelines.runtime import load_tokenizer
    from roll_core.pipelines.sources import load_rows
    from roll_core.plugins import get_plugins

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    summary = roll_core.run(None, [*RUN, "trainer.max_steps=80", f"output_dir={straight}"])
    before, after = summary["before"], summary["after"]
    assert after["eval/reward_model/rewards/accuracy"] > before["eval/reward_model/rewards/accuracy"] + 0.1
    assert after["eval/reward_model/loss"] < before["eval/reward_model/loss"] - 0.1

    roll_core.run(None, [*RUN, "trainer.max_steps=40", f"output_dir={resumed}"])
    again = roll_core.run(None, [*RUN, "trainer.max_steps=80", f"output_dir={resumed}"])  # from step 40's checkpoint
    assert again["after"] == after
    steps = [r["step"] for r in read_metrics(resumed / "metrics.jsonl") if "reward_model/loss" in r]
    assert steps == list(range(1, 81))

    # the export scores each held-out pair as the critic did at the last evaluation, up to one constant
    exported = straight / "reward_model"
    tokenizer = load_tokenizer(str(exported))
    pairs = preference_pairs(load_rows(load_config(None, RUN).data, get_plugins(), tokenizer)[1])
    chosen = scores_of(exported, tokenizer, [p["prompt"] + p["chosen"] for p in pairs])
    rejected = scores_of(exported, tokenizer, [p["prompt"] + p["rejected"] for p in pairs])
    gaps = [c - r for c, r in zip(chosen, rejected)]
    assert sum(gaps) / len(gaps) == pytest.approx(after["eval/reward_model/rewards/margin"], abs=1e-4)
    assert sum(g > 0 for g in gaps) / len(gaps) == pytest.approx(after["eval/reward_model/rewards/accuracy"])
    assert not (straight / "reward_model.partial").exists()
    assert (straight / "checkpoints" / "step_000080" / "critic" / "model" / "config.json").is_file()


def test_the_pipeline_checks_its_pairs_and_takes_the_critics_micro_batches(tmp_path):
    from conftest import write_jsonl

    from roll_core.errors import ConfigError
    from roll_core.pipelines.reward_model import RewardModelPipeline
    from roll_core.runtime import LocalExecutor

    def pipeline(*overrides):
        return RewardModelPipeline(load_config(None, [*RUN, f"output_dir={tmp_path / 'run'}", *overrides]),
                                   LocalExecutor())

    ready = pipeline("roles.critic={micro_batch_size: 4}")
    ready.prepare()
    assert (ready.spec.micro_batch_size, ready.spec.metric_prefix) == (4, "reward_model")
    ready.eval_pairs = []
    assert ready.evaluate() == {}  # no held-out pairs: nothing to measure, and no worker asked
    unpaired = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "1+2=", "ground_truth": "3"}])
    with pytest.raises(ConfigError, match="pipeline reward_model: no training row is a preference pair"):
        pipeline(f"data.train_file={unpaired}", f"data.eval_file={unpaired}").prepare()


def test_the_export_gets_a_padding_id_where_the_checkpoint_has_none(tmp_path):
    import json

    from roll_core.embedded.model import build_tiny_model
    from roll_core.pipelines.reward_model import export_sequence_classifier
    from roll_core.pipelines.runtime import load_tokenizer
    from roll_core.strategies.models import load_value_model
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_warning()  # transformers' default, whatever an earlier test left
    critic = tmp_path / "critic"
    load_value_model(str(build_tiny_model(tmp_path / "tiny")), torch.device("cpu"), seed=0).save_pretrained(critic)
    config = json.loads((critic / "config.json").read_text())
    (critic / "config.json").write_text(json.dumps({**config, "pad_token_id": None}))
    tokenizer = load_tokenizer(str(tmp_path / "tiny"))
    export_sequence_classifier(critic, tmp_path / "rm", tokenizer)
    assert hf_logging.get_verbosity() == hf_logging.WARNING  # warnings off for each head swap only
    exported = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert exported["pad_token_id"] == tokenizer.pad_token_id == 0
    assert exported["architectures"] == ["LlamaForSequenceClassification"]
