"""LoRA on PPO's critic (``roles.critic.lora``): what must hold.

The value model's backbone trains adapters while its fresh head trains whole (no adapter could turn
a random head into a value head); at first it computes what the full critic computes; a checkpoint
resumes it exactly; ``adapter/`` loads with peft onto the value model and gives its values, and a
merged ``model/`` is a plain value model with them; bad settings are refused before any worker
starts. ``fsdp2``'s LoRA critic is checked against this one in ``test_fsdp2.py``, DeepSpeed's in
roll-deepspeed's tests.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from roll_core.config import load_and_check, load_config
from roll_core.errors import ConfigError
from roll_core.strategies.hf import HFCriticStrategy
from roll_core.testing import assert_critic_adapter_gives, critic_update, hf_role, training_batch

pytest.importorskip("peft", reason="LoRA needs peft: pip install 'roll-core[lora]'")

CRITIC = ["executor=local", "algorithm.advantage_estimator=gae", "algorithm.ppo_epochs=2",
          "algorithm.ppo_mini_batch_size=4", "roles.critic.micro_batch_size=2"]
LORA = CRITIC + ["roles.critic.lora={rank: 4, alpha: 8}"]


def _critic(model_path, *overrides, seed: int = 3) -> tuple:
    cfg = load_config(None, [*LORA, *overrides])
    return cfg, HFCriticStrategy(str(model_path), cfg.roles.critic, seed=seed)


def _base_weights(critic) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in critic.model.named_parameters() if ".base_layer." in n}


def test_the_adapters_and_the_head_train_and_start_as_the_full_critic(tiny_model_path):
    cfg, critic = _critic(tiny_model_path)
    full = HFCriticStrategy(str(tiny_model_path), load_config(None, CRITIC).roles.critic, seed=3)
    batch = training_batch(critic.model.config.vocab_size)
    # B = 0 and the same seed's head: the full critic's values, before any update
    torch.testing.assert_close(critic.compute_values(batch), full.compute_values(batch), atol=1e-6, rtol=0)
    trained = {n for n, p in critic.model.named_parameters() if p.requires_grad}
    layers = critic.model.config.num_hidden_layers
    assert {n for n in trained if ".lora_" not in n} == {"base_model.model.score.modules_to_save.default.weight",
                                                         "base_model.model.score.modules_to_save.default.bias"}
    assert len([n for n in trained if ".lora_" in n]) == 2 * 7 * layers  # A and B on each of 7 linear layers
    head = critic.model.base_model.model.score.modules_to_save["default"].weight.detach().clone()
    base = _base_weights(critic)
    before = critic.compute_values(batch)
    metrics = critic_update(critic, cfg, batch)
    assert metrics["critic/grad_norm"] > 0
    assert float((critic.compute_values(batch) - before).abs().max()) > 1e-3
    assert not torch.equal(critic.model.base_model.model.score.modules_to_save["default"].weight, head)
    for name, value in _base_weights(critic).items():  # the backbone's weights stay frozen
        assert torch.equal(value, base[name]), name


def test_a_checkpoint_resumes_exactly(tiny_model_path, tmp_path):
    cfg, critic = _critic(tiny_model_path)
    batch = training_batch(critic.model.config.vocab_size)
    critic_update(critic, cfg, batch)
    critic.save_checkpoint(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt" / "model").exists()  # save: adapter (the default) writes no full model
    critic_update(critic, cfg, batch)
    _, resumed = _critic(tiny_model_path, seed=4)  # other fresh adapters and head
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    critic_update(resumed, cfg, batch)
    assert torch.equal(resumed.compute_values(batch), critic.compute_values(batch))
    expected = dict(critic.full_parameters())
    for name, value in resumed.full_parameters():
        assert torch.equal(value, expected[name]), name


def test_the_adapter_loads_with_peft_and_a_merged_save_is_a_plain_value_model(tiny_model_path, tmp_path):
    cfg, critic = _critic(tiny_model_path, "roles.critic.lora.save=merged")
    batch = training_batch(critic.model.config.vocab_size)
    critic_update(critic, cfg, batch)
    values = critic.compute_values(batch)
    critic.save_checkpoint(str(tmp_path / "ckpt"))
    assert_critic_adapter_gives(tmp_path / "ckpt" / "adapter", str(tiny_model_path), batch, values)
    # model/: the adapters merged, the trained head, no adapter weights; the plain hf critic loads it
    with safe_open(str(tmp_path / "ckpt" / "model" / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert "score.weight" in names and not [n for n in names if "lora" in n or "modules_to_save" in n]
    plain = HFCriticStrategy(str(tmp_path / "ckpt" / "model"), hf_role(load_config(None, CRITIC).roles.critic), 5)
    torch.testing.assert_close(plain.compute_values(batch), values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("overrides, message", [
    (["roles.critic.lora={target_modules: [q_proj, qkv]}"],
     r"key 'roles.critic.lora.target_modules': \['qkv'\] are not linear layers of tiny"),
    (["roles.critic.lora.rnk=4"], r"unknown key 'roles.critic.lora.rnk'. Did you mean 'rank'\?"),
    (["pipeline=reward_model"],
     r"key 'roles.critic.lora.save': pipeline reward_model exports .* set roles.critic.lora.save=merged"),
])
def test_bad_settings_are_refused_before_any_worker_starts(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_and_check(None, [*LORA, *overrides])


def test_unknown_target_modules_are_named_under_the_critics_key(tiny_model_path):
    with pytest.raises(ConfigError, match=r"^roles.critic.lora.target_modules: \['score'\] are not linear layers of "
                                          + str(tiny_model_path) + r"; its linear layers are \['down_proj', "):
        _critic(tiny_model_path, "roles.critic.lora.target_modules=[q_proj, score]")  # the head trains whole


def test_a_critic_strategy_registered_without_lora_is_refused(roll_plugins):
    from roll_core.strategy import CriticStrategy
    from roll_core.testing import hooks

    class Plain(CriticStrategy):  # never built: the config is refused first
        pass

    plugins = roll_plugins(("plain", hooks(roll_register_strategies=lambda register: register(
        "plain", Plain, kind="critic"))))
    with pytest.raises(ConfigError, match="key 'roles.critic.lora': critic strategy 'plain' does not train LoRA "
                                          "adapters; strategies that do: fsdp2, hf"):
        load_and_check(None, [*LORA, "roles.critic.strategy=plain"], plugins=plugins)


def test_ppo_trains_a_lora_critic_and_its_checkpoint_holds_the_adapter(tiny_config):
    """The pipeline end to end (local executor): PPO's critic under LoRA updates every step, and the
    run's checkpoint holds its adapter (and no full model, under ``save: adapter``)."""
    from pathlib import Path

    from conftest import metrics_of

    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.runtime import LocalExecutor

    cfg = tiny_config("algorithm.advantage_estimator=gae", "roles.critic.lora={rank: 4}", "warmup.steps=0",
                      "trainer.max_steps=2", "trainer.save_every=2", "rollout.max_new_tokens=3")
    executor = LocalExecutor()
    try:
        RLVRPipeline(cfg, executor).run()
    finally:
        executor.shutdown()
    steps = [r for r in metrics_of(cfg.output_dir) if r["step"] > 0]
    assert len(steps) == 2 and all(r["critic/grad_norm"] > 0 for r in steps)
    saved = Path(cfg.output_dir) / "checkpoints" / "step_000002" / "critic"
    assert (saved / "adapter" / "adapter_model.safetensors").is_file() and not (saved / "model").exists()
