"""The built-in ``hf`` strategies' own state and passes: a full-weight checkpoint resumes the policy
bit for bit (weights, AdamW's moments, the sampling generator) and exports a plain safetensors
model; the value model reads V(s_t) from its one-label head at the position before each response
token and resumes from its checkpoint with its head; a mini-batch's passes are sized by tokens where
the role says so and carry the batch's text columns; each optimizer phase has its own settings; the
log-distribution holds the token log-probs. Loading (``strategies/models.py``): the value head is its
seed's alone and has no dropout, a sharded checkpoint's files come from its index, the full sequence
joins prompt and response.

The pipelines' kill-and-resume tests cover the same paths end to end in minutes; these take seconds,
so mutation testing (``[tool.mutmut]``) runs them for every mutant of ``strategies/hf.py``."""

from __future__ import annotations

import shutil

import pytest
import torch

from roll_core.config import load_config
from roll_core.config.schema import CriticRoleConfig, TrainRoleConfig
from roll_core.strategies.hf import HFCriticStrategy, HFTrainStrategy
from roll_core.strategies.models import full_sequence
from roll_core.strategies.sequences import position_ids_from_mask
from roll_core.testing import grouped_training_batch, training_batch

from conftest import resume_hf_style_checkpoint


def test_a_full_weight_checkpoint_resumes_exactly_and_exports_safetensors(tiny_model_path, tmp_path):
    cfg = load_config(None, ["executor=local"])
    _, resumed = resume_hf_style_checkpoint(HFTrainStrategy, tiny_model_path, cfg, tmp_path / "ckpt")
    assert not list((tmp_path / "ckpt" / "model").glob("*.bin"))
    export = tmp_path / "export"
    resumed.export_model(str(export))
    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()


def test_a_strategy_that_only_saves_checkpoints_exports_its_models_directory(tiny_model_path, tmp_path):
    """TrainStrategy's default export_model, for a plugin strategy without one of its own: a whole
    checkpoint beside the directory, whose model/ becomes the export and whose rest is removed."""
    from pathlib import Path

    from roll_core.strategies.hf import PlainExport
    from roll_core.strategies.models import load_causal_lm
    from roll_core.strategy import TrainStrategy

    class CheckpointsOnly(HFTrainStrategy):
        export_model = TrainStrategy.export_model

        def save_checkpoint(self, path: str) -> None:
            PlainExport.export_model(self, str(Path(path) / "model"))
            torch.save({"optimizer": self.optimizers["default"].state_dict()}, Path(path) / "train_state.pt")

    strategy = CheckpointsOnly(str(tiny_model_path), TrainRoleConfig(), seed=0)
    with torch.no_grad():
        strategy.model.model.norm.weight.fill_(0.5)  # not the tiny model's own weights
    (tmp_path / "warm").mkdir()
    strategy.export_model(str(tmp_path / "warm" / "model"))
    assert sorted(p.name for p in (tmp_path / "warm").iterdir()) == ["model"]  # the scratch checkpoint is gone
    exported = dict(load_causal_lm(str(tmp_path / "warm" / "model")).named_parameters())
    for name, value in strategy.model.named_parameters():
        torch.testing.assert_close(exported[name], value, atol=0, rtol=0, msg=name)


def _heads(critic, batch):
    """The value head's output read by hand: logits[..., 0] at the position before each response token."""
    ids, mask = (t.to(critic.device) for t in full_sequence(batch))  # the model is on CUDA where there is one
    with torch.no_grad():
        logits = critic.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    width = batch["responses"].shape[1]
    return logits[:, -width - 1:-1, 0].cpu() * batch["response_mask"]


def test_values_are_the_heads_output_before_each_response_token_and_zero_past_the_response(tiny_model_path):
    batch = training_batch(vocab=90)
    assert not batch["response_mask"].all()  # some responses end early: their padding must read 0
    critic = HFCriticStrategy(str(tiny_model_path), CriticRoleConfig(pack_sequences=False), seed=0)
    critic.model.eval()
    values = critic.forward(batch, ("values",), 1.0)["values"]
    torch.testing.assert_close(values, _heads(critic, batch), atol=1e-6, rtol=1e-6)
    assert float(values.abs().sum()) > 0.01 and not values[batch["response_mask"] == 0].any()
    grouped = grouped_training_batch(vocab=90)  # packed rows give the same values
    packed = HFCriticStrategy(str(tiny_model_path), CriticRoleConfig(), seed=0).forward(grouped, ("values",), 1.0)
    torch.testing.assert_close(packed["values"], _heads(critic, grouped), atol=1e-5, rtol=1e-5)


def test_the_value_model_resumes_with_its_head_and_optimizer(tiny_model_path, tmp_path):
    batch = training_batch(vocab=90)
    critic = HFCriticStrategy(str(tiny_model_path), CriticRoleConfig(), seed=0)
    loss = critic.model(input_ids=full_sequence(batch)[0].to(critic.device)).logits[..., 0].pow(2).mean()
    critic.backward(loss)
    critic.optimizer_step()
    critic.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = HFCriticStrategy(str(tiny_model_path), CriticRoleConfig(), seed=1)  # another fresh head
    before = resumed.forward(batch, ("values",), 1.0)["values"]
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    after = resumed.forward(batch, ("values",), 1.0)["values"]
    torch.testing.assert_close(after, critic.forward(batch, ("values",), 1.0)["values"], atol=0, rtol=0)
    assert not torch.equal(before, after)
    saved, loaded = critic.optimizers["default"].state_dict(), resumed.optimizers["default"].state_dict()
    for key, state in saved["state"].items():
        torch.testing.assert_close(loaded["state"][key]["exp_avg"], state["exp_avg"], atol=0, rtol=0)


class _MicroBatchRecorder:
    """A loss over the policy's log-probs that records the samples and text columns of each micro-batch."""

    outputs = frozenset({"log_probs"})
    temperature = 1.0
    additive = frozenset()

    def __init__(self):
        self.micros = []

    def __call__(self, out, micro, tokens, seqs):
        self.micros.append((len(micro), dict(micro.non_tensors)))
        return (out["log_probs"] * micro["response_mask"]).sum() / tokens, {}


def test_forward_backward_sizes_micro_batches_by_tokens_and_keeps_their_text_columns(tiny_model_path):
    """``max_tokens_per_micro_batch`` reaches the strategy's passes: 8 samples of 5-9 tokens, at most
    20 tokens a pass, take 4 passes where a size of 8 alone takes one. Each pass keeps its samples' rows
    of the batch's non-tensor columns (a loss may read them)."""
    batch = training_batch(vocab=90)
    batch.non_tensors["domain"] = [f"d{i}" for i in range(len(batch))]
    tokens = batch.sample_tokens().tolist()
    assert max(tokens) <= 9 and sum(tokens) > 60
    runs = {}
    for max_tokens in (None, 20):
        trainer = HFTrainStrategy(str(tiny_model_path), TrainRoleConfig(max_tokens_per_micro_batch=max_tokens), seed=0)
        recorder = _MicroBatchRecorder()
        trainer.forward_backward(batch, recorder, micro_batch_size=8, denominators=(float(sum(tokens)), 8.0))
        runs[max_tokens] = recorder.micros
    assert [n for n, _ in runs[None]] == [8]
    assert len(runs[20]) == 4 and sum(n for n, _ in runs[20]) == 8
    assert [d for _, cols in runs[20] for d in cols["domain"]] == [f"d{i}" for i in range(8)]


def test_a_named_optimizer_starts_at_its_phase_s_lr_or_the_role_s_and_an_lr_given_applies(tiny_model_path):
    """The role's optimizer has the role's lr and weight decay; a phase's optimizer (created on first
    use) a new AdamW's settings with the phase's lr, or the role's where the phase gives none, as the
    other backends make theirs. (The role's values differ from AdamW's defaults, 1e-3 and 0.01.)"""
    trainer = HFTrainStrategy(str(tiny_model_path), TrainRoleConfig(lr=3e-3, weight_decay=0.05), seed=0)
    def settings(name):
        return [(group["lr"], group["weight_decay"]) for group in trainer.optimizers[name].param_groups]
    trainer.optimizer_step("warmup")  # a new phase without an lr of its own: the role's
    trainer.optimizer_step("phase", lr=5e-4)
    assert settings("default") == [(3e-3, 0.05)]
    assert settings("warmup") == [(3e-3, 0.01)] and settings("phase") == [(5e-4, 0.01)]
    trainer.optimizer_step("default", lr=2e-4)  # an lr given to an existing optimizer replaces its own
    trainer.optimizer_step("phase", lr=1e-4)
    assert settings("default") == [(2e-4, 0.05)] and settings("phase") == [(1e-4, 0.01)]
    assert settings("warmup") == [(3e-3, 0.01)]


def test_the_log_distribution_holds_the_token_log_probs_and_sums_to_one_inside_the_response(tiny_model_path):
    batch = training_batch(vocab=90)
    trainer = HFTrainStrategy(str(tiny_model_path), TrainRoleConfig(), seed=0)
    trainer.model.eval()
    dist = trainer.compute_log_probs(batch, 0.7, distribution=True)
    tokens = trainer.compute_log_probs(batch, 0.7)
    mask = batch["response_mask"].bool()
    assert dist.shape == (*batch["responses"].shape, trainer.model.config.vocab_size)
    torch.testing.assert_close(dist.gather(-1, batch["responses"][..., None]).squeeze(-1), tokens)
    torch.testing.assert_close(dist.exp().sum(-1)[mask], torch.ones(int(mask.sum())))
    assert not dist[~mask].any()


# -- loading (roll_core.strategies.models) ------------------------------------------------------------

def test_a_value_models_head_depends_on_its_seed_alone_and_has_no_dropout(tiny_model_path):
    """The head is ``fresh_value_head``'s for the seed (what roll-megatron's critic draws too), the
    caller's RNG stream untouched; its dropout is off, so values in training mode are the rollout's;
    and transformers' verbosity is what it was."""
    from transformers.utils import logging as hf_logging

    from roll_core.strategies.models import fresh_value_head, load_value_model

    verbosity, rng = hf_logging.get_verbosity(), torch.get_rng_state()
    hf_logging.set_verbosity_info()  # not the error level the load sets while it reports the new head
    try:
        first, again, other = (load_value_model(str(tiny_model_path), torch.device("cpu"), seed) for seed in (3, 3, 4))
        assert hf_logging.get_verbosity() == hf_logging.INFO
    finally:
        hf_logging.set_verbosity(verbosity)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(first.score.weight, again.score.weight)
    assert not torch.equal(first.score.weight, other.score.weight)
    head = fresh_value_head(first.config.hidden_size, first.config.initializer_range, 3)
    assert torch.equal(first.score.weight, head["weight"]) and torch.equal(first.score.bias, head["bias"])
    assert float(head["weight"].std()) == pytest.approx(first.config.initializer_range, rel=0.2)
    first.train()
    ids = torch.tensor([[1, 20, 21, 22, 23]])
    passes = [first(input_ids=ids).logits for _ in range(2)]
    assert first.config.classifier_dropout == 0.0 and torch.equal(*passes)


def test_a_value_model_keeps_a_trained_head_and_refuses_a_checkpoint_without_its_backbone(tiny_model_path, tmp_path):
    from safetensors.torch import load_file, save_file

    from roll_core.strategies.models import load_value_model

    trained = load_value_model(str(tiny_model_path), torch.device("cpu"), seed=3)
    with torch.no_grad():
        trained.score.bias.fill_(0.5)
    trained.save_pretrained(tmp_path / "critic")
    again = load_value_model(str(tmp_path / "critic"), torch.device("cpu"), seed=4)  # its own head, not seed 4's
    assert torch.equal(again.score.weight, trained.score.weight) and float(again.score.bias) == 0.5

    shutil.copytree(tiny_model_path, tmp_path / "partial")
    weights = load_file(tmp_path / "partial" / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "partial" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"needs beyond its new head: \['model.norm.weight'\]"):
        load_value_model(str(tmp_path / "partial"), torch.device("cpu"), seed=3)


def test_a_checkpoints_files_are_its_one_file_or_those_its_index_names_once_each(tmp_path):
    import json

    from roll_core.strategies.models import safetensors_files

    assert safetensors_files(str(tmp_path)) == [tmp_path / "model.safetensors"]
    weight_map = {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                  "c": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert safetensors_files(str(tmp_path)) == [tmp_path / "model-00001-of-00002.safetensors",
                                                tmp_path / "model-00002-of-00002.safetensors"]


def test_the_full_sequence_is_the_prompt_then_the_response_with_both_masks():
    from roll_core.data import Batch

    batch = Batch({"prompt_ids": torch.tensor([[0, 7], [8, 9]]), "prompt_mask": torch.tensor([[0, 1], [1, 1]]),
                   "responses": torch.tensor([[5, 0], [6, 4]]), "response_mask": torch.tensor([[1, 0], [1, 1]])})
    ids, mask = full_sequence(batch)
    assert ids.tolist() == [[0, 7, 5, 0], [8, 9, 6, 4]] and mask.tolist() == [[0, 1, 1, 0], [1, 1, 1, 1]]
