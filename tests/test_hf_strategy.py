"""The built-in ``hf`` strategies' own state: a full-weight checkpoint resumes the policy bit for
bit (weights, AdamW's moments, the sampling generator) and exports a plain safetensors model; the
value model reads V(s_t) from its one-label head at the position before each response token and
resumes from its checkpoint with its head.

The pipelines' kill-and-resume tests cover the same paths end to end in minutes; these take seconds,
so mutation testing (``[tool.mutmut]``) runs them for every mutant of ``strategies/hf.py``."""

from __future__ import annotations

import torch

from roll_core.config import load_config
from roll_core.config.schema import CriticRoleConfig
from roll_core.strategies.hf import HFCriticStrategy, HFTrainStrategy
from roll_core.strategies.models import full_sequence
from roll_core.strategies.sequences import position_ids_from_mask
from roll_core.testing import assert_checkpoint_resumes_exactly, training_batch

from conftest import grouped_training_batch


def test_a_full_weight_checkpoint_resumes_exactly_and_exports_safetensors(tiny_model_path, tmp_path):
    cfg = load_config(None, ["executor=local"])
    made = []

    def make_trainer(seed):
        made.append(HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=seed))
        return made[-1]

    assert_checkpoint_resumes_exactly(make_trainer, cfg, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model" / "model.safetensors").is_file()
    assert not list((tmp_path / "ckpt" / "model").glob("*.bin"))
    # the sampling generator resumes too: the strategy built with seed 1 draws on with seed 0's state
    saved = torch.load(tmp_path / "ckpt" / "train_state.pt", weights_only=False)["generator"]
    resumed = made[1]
    assert torch.equal(resumed.rng_state(), saved)
    assert not torch.equal(saved, torch.Generator(device="cpu").manual_seed(1).get_state())
    export = tmp_path / "export"
    resumed.export_model(str(export))
    assert (export / "model.safetensors").is_file() and (export / "config.json").is_file()


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
