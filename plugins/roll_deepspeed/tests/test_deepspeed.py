"""roll-deepspeed on the real DeepSpeed (its CPU accelerator over gloo here).

What must hold: on the tiny model and a fixed batch, every ZeRO stage gives the ``hf`` strategy's
log-probs (fp32, within 1e-4) and, after one core update, its weights; two data-parallel ranks give
what one worker gives on the whole batch; a checkpoint resumes exactly; the options are checked by
``roll validate`` before any worker starts. Under LoRA (stages 1-2) the adapters train, fold and
resume as under ``hf``.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from roll_core.algorithms.objective import ActorObjective
from roll_core.config import load_and_check, load_config
from roll_core.errors import ConfigError
from roll_core.strategies.hf import HFCriticStrategy, HFTrainStrategy
from roll_core.testing import (assert_checkpoint_resumes_exactly, assert_registered_lazily,
                               assert_run_survives_a_killed_worker, assert_trainer_matches_hf, critic_update,
                               data_parallel_update, full_weights, hf_role, training_batch)
from roll_core.training import UpdateSpec, update

pytest.importorskip("deepspeed", reason="roll-deepspeed's tests need DeepSpeed: pip install roll-deepspeed")

from roll_deepspeed.strategy import DeepSpeedCriticStrategy, DeepSpeedTrainStrategy  # noqa: E402

# Two PPO epochs of two mini-batches each, micro-batches of 2: accumulation, clipping and Adam moments
# all take part. A KL and an entropy term put every part of the actor loss into the gradients.
UPDATE = ["algorithm.ppo_epochs=2", "algorithm.ppo_mini_batch_size=4", "algorithm.kl_loss_coef=0.1",
          "algorithm.entropy_coef=0.01", "algorithm.max_grad_norm=0.5", "roles.actor_train.micro_batch_size=2"]
LORA = ["roles.actor_train.lora={rank: 8, alpha: 16}"]
# Stage 3 keeps parameters under 100,000 elements whole on every rank (DeepSpeed's persistence
# threshold), which is every one of the tiny model's, and leaves gathered ones gathered while fewer
# than 10^9 elements are (its live and reuse limits): with these at 0 each parameter is partitioned
# and released after every use, as a large model's are.
PARTITION_ALL = ("zero_config: {stage3_param_persistence_threshold: 0, stage3_max_live_parameters: 0, "
                 "stage3_max_reuse_distance: 0, stage3_prefetch_bucket_size: 0}")


def stage(n: int) -> str:
    """strategy_options for ZeRO stage ``n`` (stage 3: every parameter partitioned)."""
    return f"{{zero_stage: {n}, {PARTITION_ALL}}}" if n == 3 else f"{{zero_stage: {n}}}"


def config(*options: str):
    return load_config(None, UPDATE + [f"roles.actor_train.strategy_options={{{', '.join(options)}}}"])


@pytest.mark.parametrize("options", [
    ("zero_stage: 1",), ("zero_stage: 2",), ("zero_stage: 3", PARTITION_ALL),
    ("zero_stage: 2", "offload_optimizer: true"),
    ("zero_stage: 3", "offload_params: true", "offload_optimizer: true", PARTITION_ALL),
], ids=["zero1", "zero2", "zero3", "zero2-offload", "zero3-offload"])
def test_every_stage_computes_what_hf_computes(tiny_model_path, options):
    cfg = config(*options)
    trainer = DeepSpeedTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    reference = HFTrainStrategy(str(tiny_model_path), hf_role(cfg.roles.actor_train), seed=0)
    metrics = assert_trainer_matches_hf(trainer, reference, cfg)
    assert metrics["train/grad_norm"] > cfg.algorithm.max_grad_norm  # so clipping really acted
    assert trainer.engine.optimizer.optimizer.defaults["fused"] is True  # stepped ZeRO's partitions fused, as hf
    assert trainer.shared_parameters() is None  # ZeRO owns the tensors: a hybrid engine gets gathered copies
    # no shared-memory all-reduce was compiled for the backend (training's collectives are torch's)
    from deepspeed.comm import comm

    assert comm.cdb.shm_comm_op is None


def test_compiled_decoder_layers_train_as_hf_does_and_zero_3_refuses_them(tiny_model_path):
    """``compile: true`` under ZeRO-2: each decoder layer compiled (TorchInductor fuses its
    elementwise work), the update the eager hf trainer's. ZeRO-3's parameter hooks sit inside the
    layers, so roll validate refuses that pairing before any worker starts."""
    from roll_core.strategies.compiled import decoder_layers

    cfg = load_and_check(None, UPDATE + ["roles.actor_train.strategy=deepspeed", "roles.actor_train.compile=true",
                                         "roles.actor_train.strategy_options={zero_stage: 2}"])
    trainer = DeepSpeedTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    layers = decoder_layers(trainer.module)
    assert layers and all(hasattr(m.forward, "_torchdynamo_orig_callable") for m in layers)
    eager = hf_role(cfg.roles.actor_train).model_copy(update={"compile": False})
    assert_trainer_matches_hf(trainer, HFTrainStrategy(str(tiny_model_path), eager, seed=0), cfg)
    for role in ("actor_train", "critic"):
        with pytest.raises(ConfigError, match=f"key 'roles.{role}.strategy_options': compile: true needs zero_stage "
                                              "1 or 2: ZeRO-3 gathers"):
            load_and_check(None, ["algorithm.advantage_estimator=gae", f"roles.{role}.strategy=deepspeed",
                                  f"roles.{role}.compile=true", f"roles.{role}.strategy_options={{zero_stage: 3}}"])


@pytest.mark.parametrize("zero", [2, 3])
def test_an_image_text_model_trains_as_hf_does(tiny_vlm_path, zero):
    """The tiny model with its vision tower (roll_core.multimodal): image prompts' log-probs,
    metrics and updated weights, the encoder's included, are hf's (stage 3 partitions them all)."""
    from roll_core.testing import image_training_batch

    cfg = load_config(None, UPDATE + [f"roles.actor_train.strategy_options={stage(zero)}"])
    trainer = DeepSpeedTrainStrategy(str(tiny_vlm_path), cfg.roles.actor_train, seed=0)
    reference = HFTrainStrategy(str(tiny_vlm_path), hf_role(cfg.roles.actor_train), seed=0)
    assert_trainer_matches_hf(trainer, reference, cfg, batch=image_training_batch(tiny_vlm_path))


def test_an_update_raises_no_warning_of_deepspeeds_deprecated_collective_names(tiny_model_path):
    """ZeRO calls torch's all_gather_into_tensor and reduce_scatter_tensor, which warn per call site in
    every worker of every run; the strategy silences those two and nothing else."""
    cfg = config("zero_stage: 3", PARTITION_ALL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = DeepSpeedTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
        update(trainer, training_batch(trainer.module.config.vocab_size),
               ActorObjective.from_config(cfg.algorithm, cfg.rollout), UpdateSpec.from_config(cfg.algorithm,
                                                                                              cfg.roles.actor_train))
        warnings.warn("`torch.distributed.broadcast_object` is deprecated", FutureWarning)  # another still shows
    deprecated = [str(w.message) for w in caught if str(w.message).startswith("`torch.distributed.")]
    assert deprecated == ["`torch.distributed.broadcast_object` is deprecated"], deprecated


def test_bf16_trains_near_the_fp32_result(tiny_model_path):
    cfg = config("zero_stage: 2", "precision: bf16")
    trainer = DeepSpeedTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    reference = HFTrainStrategy(str(tiny_model_path), hf_role(cfg.roles.actor_train), seed=0)
    batch = training_batch(reference.model.config.vocab_size)
    mask = batch["response_mask"]
    got, expected = (s.compute_log_probs(batch, 1.0) * mask for s in (trainer, reference))
    assert next(trainer.module.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=0.1, rtol=0)  # bfloat16 keeps 8 bits of mantissa
    loss_fn, spec = ActorObjective.from_config(cfg.algorithm, cfg.rollout), UpdateSpec.from_config(
        cfg.algorithm, cfg.roles.actor_train)
    ours, theirs = update(trainer, batch, loss_fn, spec), update(reference, batch, loss_fn, spec)
    assert ours["train/skipped_updates"] == 0
    assert ours["train/pg_loss"] == pytest.approx(theirs["train/pg_loss"], abs=0.05)


def test_a_non_finite_loss_skips_the_step_and_leaves_the_weights(tiny_model_path):
    cfg = config("zero_stage: 2")
    trainer = DeepSpeedTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    batch = training_batch(trainer.module.config.vocab_size)
    batch.tensors["advantages"][0, 0] = float("nan")
    before = {n: t.clone() for n, t in full_weights(trainer).items()}
    loss_fn, spec = ActorObjective.from_config(cfg.algorithm, cfg.rollout), UpdateSpec(
        max_grad_norm=1.0, micro_batch_size=2)
    metrics = update(trainer, batch, loss_fn, spec)
    assert metrics["train/skipped_updates"] == 1.0
    for name, value in full_weights(trainer).items():
        assert torch.equal(value, before[name]), name
    batch.tensors["advantages"][0, 0] = 0.0
    assert update(trainer, batch, loss_fn, spec)["train/skipped_updates"] == 0.0  # nothing stale was kept


def test_a_warm_up_phase_then_rl_matches_hf(tiny_model_path):
    """Phases with their own optimizer (the supervised warm-up, then RL) start from fresh moments,
    as hf's separate optimizers do."""
    cfg = config("zero_stage: 2")
    trainer = DeepSpeedTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    reference = HFTrainStrategy(str(tiny_model_path), hf_role(cfg.roles.actor_train), seed=0)
    batch = training_batch(reference.model.config.vocab_size)
    loss_fn = ActorObjective.from_config(cfg.algorithm, cfg.rollout)
    warmup = UpdateSpec(max_grad_norm=1.0, micro_batch_size=4, optimizer="warmup", lr=1e-3, epochs=2)
    rl = UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train)
    for spec in (warmup, rl):
        update(trainer, batch, loss_fn, spec)
        update(reference, batch, loss_fn, spec)
    got, expected = full_weights(trainer), full_weights(reference)
    # Six Adam steps from weights that already differ by float rounding (~1e-7): Adam's first steps
    # are nearly sign(gradient) * lr, so rounding moves a weight by up to ~1e-5. A phase that kept
    # its moments, or the wrong learning rate, moves weights by ~lr = 3e-4.
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=5e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("zero", [2, 3])
def test_a_checkpoint_resumes_exactly(tiny_model_path, tmp_path, zero):
    cfg = load_config(None, UPDATE + [f"roles.actor_train.strategy_options={stage(zero)}"])
    assert_checkpoint_resumes_exactly(
        lambda seed: DeepSpeedTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed), cfg, tmp_path / "ckpt")


@pytest.mark.parametrize("images", [False, True], ids=["text", "image-text"])
def test_the_critic_computes_what_hf_computes(images, request):
    """At ZeRO-3, the text model's critic and the image-text model's on image prompts."""
    from roll_core.testing import image_training_batch

    tiny_model_path = request.getfixturevalue("tiny_vlm_path" if images else "tiny_model_path")
    cfg = load_config(None, UPDATE + ["algorithm.advantage_estimator=gae", "roles.critic.micro_batch_size=2",
                                      f"roles.critic.strategy_options={stage(3)}"])
    critic = DeepSpeedCriticStrategy(str(tiny_model_path), cfg.roles.critic, seed=0)
    reference = HFCriticStrategy(str(tiny_model_path), hf_role(cfg.roles.critic), seed=0)
    batch = image_training_batch(tiny_model_path) if images else training_batch(reference.model.config.vocab_size)
    mask = batch["response_mask"]
    torch.testing.assert_close(critic.compute_values(batch) * mask, reference.compute_values(batch) * mask,
                               atol=1e-5, rtol=0)
    ours, theirs = critic_update(critic, cfg, batch), critic_update(reference, cfg, batch)
    assert ours["critic/value_loss"] == pytest.approx(theirs["critic/value_loss"], rel=1e-4)
    torch.testing.assert_close(critic.compute_values(batch) * mask, reference.compute_values(batch) * mask,
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("zero", [2, 3])
def test_a_lora_critic_trains_saves_and_resumes_as_hf_does(tiny_model_path, tmp_path, zero):
    """roles.critic.lora: the adapters and the whole value head train as the ``hf`` LoRA critic's
    (ZeRO-3 partitions the head's trained copy too), a merged model/ is a plain value model with its
    values, and the checkpoint resumes the next update exactly."""
    cfg = load_config(None, UPDATE + ["algorithm.advantage_estimator=gae", "roles.critic.micro_batch_size=2",
                                      "roles.critic.lora={rank: 4, alpha: 8, save: merged}",
                                      f"roles.critic.strategy_options={stage(zero)}"])
    critic = DeepSpeedCriticStrategy(str(tiny_model_path), cfg.roles.critic, seed=0)
    reference = HFCriticStrategy(str(tiny_model_path), hf_role(cfg.roles.critic), seed=0)
    batch = training_batch(reference.model.config.vocab_size)
    mask = batch["response_mask"]
    ours, theirs = critic_update(critic, cfg, batch), critic_update(reference, cfg, batch)
    for key in ("critic/value_loss", "critic/grad_norm"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-4), key
    after = reference.compute_values(batch) * mask
    torch.testing.assert_close(critic.compute_values(batch) * mask, after, atol=1e-4, rtol=0)
    critic.save_checkpoint(str(tmp_path / "ckpt"))
    plain = HFCriticStrategy(str(tmp_path / "ckpt" / "model"), hf_role(cfg.roles.critic).model_copy(
        update={"lora": None}), seed=5)
    torch.testing.assert_close(plain.compute_values(batch) * mask, after, atol=1e-4, rtol=0)
    critic_update(critic, cfg, batch)
    resumed = DeepSpeedCriticStrategy(str(tiny_model_path), cfg.roles.critic, seed=1)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    critic_update(resumed, cfg, batch)
    assert torch.equal(resumed.compute_values(batch), critic.compute_values(batch))


def test_the_critic_trains_on_packed_rows_as_on_padded_ones(tiny_model_path, monkeypatch):
    """roles.critic.pack_sequences on deepspeed: accepted by roll validate, the passes really packed,
    and the values and the update's loss those of padded rows."""
    import roll_core.strategies.hf as hf_strategy

    packed_passes = []
    original = hf_strategy.packed_forward
    monkeypatch.setattr(hf_strategy, "packed_forward", lambda *a, **k: packed_passes.append(1) or original(*a, **k))
    results = {}
    for pack in (True, False):
        cfg = load_and_check(None, ["algorithm.advantage_estimator=gae", "roles.critic.strategy=deepspeed",
                                    "roles.critic.micro_batch_size=2", f"roles.critic.pack_sequences={pack}",
                                    f"roles.critic.strategy_options={stage(3)}"])
        critic = DeepSpeedCriticStrategy(str(tiny_model_path), cfg.roles.critic, seed=0)
        batch, before = training_batch(critic.module.config.vocab_size), len(packed_passes)
        values = critic.compute_values(batch)
        metrics = critic_update(critic, cfg, batch)
        results[pack] = (values, critic.compute_values(batch), metrics["critic/value_loss"], len(packed_passes) - before)
    (packed, packed_after, packed_loss, passes), (padded, padded_after, padded_loss, none) = results[True], results[False]
    assert passes > 0 and none == 0
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed_after, padded_after, atol=1e-5, rtol=0)
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5)


@pytest.mark.ray
@pytest.mark.parametrize("zero, adapters", [(2, False), (3, False), (2, True), (3, True)],
                         ids=["zero2", "zero3", "zero2-lora", "zero3-lora"])
def test_two_data_parallel_ranks_match_one_worker_on_the_whole_batch(tiny_model_path, zero, adapters):
    """``zero2-lora``, ``zero3-lora``: what a sync sends is the adapters (under stage 3 gathered from
    both ranks' partitions), against one ``hf`` worker's."""
    overrides = UPDATE + ["executor=ray", "roles.actor_train.micro_batch_size=1"] + (LORA if adapters else [])
    one = load_config(None, overrides)
    reference = HFTrainStrategy(str(tiny_model_path), hf_role(one.roles.actor_train), seed=0)
    batch = training_batch(reference.model.config.vocab_size)
    expected_metrics = update(reference, batch, ActorObjective.from_config(one.algorithm, one.rollout),
                              UpdateSpec.from_config(one.algorithm, one.roles.actor_train))
    expected = full_weights(reference)

    cfg = load_config(None, overrides + ["roles.actor_train.strategy=deepspeed", "roles.actor_train.num_workers=2",
                                         f"roles.actor_train.strategy_options={stage(zero)}"])
    metrics, (params, replica), log_probs = data_parallel_update(str(tiny_model_path), cfg, batch, world=2)
    assert replica == {} and params.keys() == expected.keys()  # rank 0 sends every weight, in full
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-5, msg=name)
    torch.testing.assert_close(log_probs[0], log_probs[1])
    for key in ("train/pg_loss", "train/kl", "train/grad_norm"):
        assert metrics[0][key] == pytest.approx(expected_metrics[key], rel=1e-4, abs=1e-6), key


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_worker_restarts_the_run_from_a_deepspeed_checkpoint(tmp_path):
    assert_run_survives_a_killed_worker(tmp_path / "run", "roles.actor_train.strategy=deepspeed",
                                        "roles.actor_train.num_workers=2",
                                        "roles.actor_train.strategy_options={zero_stage: 3}")


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_lora_trains_the_adapters_as_hf_does(tiny_model_path, tmp_path, zero):
    pytest.importorskip("peft")
    cfg = load_config(None, UPDATE + LORA + [f"roles.actor_train.strategy_options={stage(zero)}"])
    trainer = DeepSpeedTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    reference = HFTrainStrategy(str(tiny_model_path), hf_role(cfg.roles.actor_train), seed=0)
    assert_trainer_matches_hf(trainer, reference, cfg, weight_atol=1e-6)  # the adapters a sync sends
    trainable = {n for n, p in trainer.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "adapter").is_dir() and not (tmp_path / "ckpt" / "model").exists()  # save: adapter


@pytest.mark.parametrize("zero", [2, 3])
def test_lora_checkpoints_folds_and_trains_on_as_hf_does(tiny_model_path, tmp_path, zero):
    """After a fold (the warm-up's adapters into the base) the next step trains the fresh adapters,
    not the old ones the engine's master copies held; a checkpoint then resumes on the folded base.
    Under stage 3 the base weights, adapters and master copies are all partitions."""
    pytest.importorskip("peft")
    from roll_core.strategies.models import load_causal_lm

    cfg = load_config(None, UPDATE + LORA + ["roles.actor_train.lora.save=merged",
                                             f"roles.actor_train.strategy_options={stage(zero)}"])
    loss_fn = ActorObjective.from_config(cfg.algorithm, cfg.rollout)
    spec = UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train)
    trainer = DeepSpeedTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    reference = HFTrainStrategy(str(tiny_model_path), hf_role(cfg.roles.actor_train), seed=0)
    batch = training_batch(reference.model.config.vocab_size)
    for strategy in (trainer, reference):
        update(strategy, batch, loss_fn, spec)
        strategy.export_model(str(tmp_path / f"warm-{type(strategy).__name__}"))
        strategy.fold_adapters(str(tmp_path / f"warm-{type(strategy).__name__}"))
        update(strategy, batch, loss_fn, spec)
    got, expected = full_weights(trainer), full_weights(reference)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-4, msg=name)
    policy = trainer.compute_log_probs(batch, 1.0)

    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors").is_file()
    merged = load_causal_lm(str(tmp_path / "ckpt" / "model"))
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    plain = load_config(None, UPDATE)  # the merged model/ is a plain checkpoint of the policy
    torch.testing.assert_close(HFTrainStrategy(str(tmp_path / "ckpt" / "model"), plain.roles.actor_train, seed=0)
                               .compute_log_probs(batch, 1.0), policy, atol=1e-5, rtol=0)
    resumed = DeepSpeedTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=1)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    torch.testing.assert_close(resumed.compute_log_probs(batch, 1.0), policy, atol=1e-6, rtol=0)
    torch.testing.assert_close(resumed.base_log_probs(batch, 1.0), trainer.base_log_probs(batch, 1.0),
                               atol=1e-6, rtol=0)  # the folded base, not the tiny model
    resumed.save_checkpoint(str(tmp_path / "again"))  # and its adapter names that base, as the engines rebase on it
    assert json.loads((tmp_path / "again" / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == str(tmp_path / "warm-DeepSpeedTrainStrategy")
    update(resumed, batch, loss_fn, spec)
    update(trainer, batch, loss_fn, spec)
    for name, value in full_weights(trainer).items():
        torch.testing.assert_close(full_weights(resumed)[name], value, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("options, message", [
    ("{zero_stag: 3}", "unknown option 'zero_stag'. Did you mean 'zero_stage'?"),
    ("{zero_stage: 4}", "roles.actor_train.strategy_options.zero_stage"),
    ("{offload_params: true}", "offload_params needs zero_stage 3 (got zero_stage 2)"),
    ("{zero_config: {overlap_com: true}}", "unknown DeepSpeed zero_optimization argument 'overlap_com'. "
                                           "Did you mean 'overlap_comm'?"),
    ("{zero_config: {stage: 3}}", "set strategy_options.zero_stage, not zero_config.stage"),
])
def test_options_are_checked_before_any_worker_starts(options, message):
    with pytest.raises(ConfigError) as err:
        load_and_check(None, ["roles.actor_train.strategy=deepspeed", f"roles.actor_train.strategy_options={options}"])
    assert message in str(err.value)
    load_and_check(None, ["roles.actor_train.strategy=deepspeed", "roles.actor_train.strategy_options={zero_stage: 2}"])


def test_valid_options_reach_the_strategy_validated():
    cfg = load_and_check(None, ["roles.actor_train.strategy=deepspeed",
                                "roles.actor_train.strategy_options={zero_stage: 3, zero_config: {overlap_comm: true}}"])
    assert cfg.roles.actor_train.strategy_options["zero_stage"] == 3
    assert cfg.roles.actor_train.strategy_options["precision"] == "fp32"  # defaults filled in


def test_the_plugin_registers_deepspeed_without_importing_it():
    assert_registered_lazily("train", "deepspeed", "deepspeed")
    assert_registered_lazily("critic", "deepspeed", "deepspeed")
