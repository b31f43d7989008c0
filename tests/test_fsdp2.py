"""The ``fsdp2`` training strategy in this process, as one worker runs it (a process group of one):
every decoder layer is an FSDP unit of its own, and a checkpoint of the sharded model and optimizer
resumes the policy bit for bit and exports a plain safetensors model. Under LoRA it trains the
adapters as ``hf`` does, and its checkpoints, exports and folds give the policy's log-probs, on one
rank here and on two plain gloo processes (where every adapter and weight is split in two shards).

``test_distributed.py`` checks two ranks against one ``hf`` worker and a killed worker's restart on
Ray, in minutes; this takes seconds, so hand mutants of ``strategies/fsdp2.py`` run against it."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import resume_hf_style_checkpoint

from roll_core.config import load_config


@pytest.fixture
def process_group():
    """The group of one that the strategy opens, closed afterwards: later tests start without one."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_sharded_checkpoint_resumes_exactly(tiny_model_path, tmp_path, process_group):
    from torch.distributed.fsdp import FSDPModule

    from roll_core.strategies.compiled import decoder_layers
    from roll_core.strategies.fsdp2 import FSDP2TrainStrategy

    cfg = load_config(None, ["executor=local", "roles.actor_train.strategy=fsdp2"])
    saved, _ = resume_hf_style_checkpoint(FSDP2TrainStrategy, tiny_model_path, cfg, tmp_path / "ckpt")
    layers = decoder_layers(saved.model)
    assert len(layers) == saved.model.config.num_hidden_layers
    assert all(isinstance(m, FSDPModule) for m in layers + [saved.model])


LORA = ["executor=local", "roles.actor_train.strategy=fsdp2", "roles.actor_train.lora={rank: 8, alpha: 16}",
        "algorithm.kl_loss_coef=0.1", "algorithm.ppo_mini_batch_size=4", "roles.actor_train.micro_batch_size=2"]


def test_lora_under_fsdp2_trains_the_adapters_as_hf_does(tiny_model_path, process_group):
    pytest.importorskip("peft")
    from roll_core.strategies.fsdp2 import FSDP2TrainStrategy
    from roll_core.strategies.hf import HFTrainStrategy
    from roll_core.testing import assert_trainer_matches_hf, hf_role

    cfg = load_config(None, LORA)
    sharded = FSDP2TrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    reference = HFTrainStrategy(str(tiny_model_path), hf_role(cfg.roles.actor_train), seed=0)
    assert_trainer_matches_hf(sharded, reference, cfg, log_prob_atol=1e-6, weight_atol=1e-6)  # the adapters sent
    trainable = {n for n, p in sharded.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)


def test_lora_under_fsdp2_checkpoints_exports_and_folds_the_policy(tiny_model_path, tmp_path, process_group):
    pytest.importorskip("peft")
    from peft import PeftModel

    from roll_core.algorithms.objective import ActorObjective
    from roll_core.strategies.fsdp2 import FSDP2TrainStrategy
    from roll_core.strategies.hf import HFTrainStrategy
    from roll_core.strategies.models import load_causal_lm
    from roll_core.testing import full_weights, training_batch
    from roll_core.training import UpdateSpec, update

    cfg = load_config(None, LORA + ["roles.actor_train.lora.save=merged"])
    loss_fn = ActorObjective.from_config(cfg.algorithm, cfg.rollout)
    spec = UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train)
    trainer = FSDP2TrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    batch = training_batch(trainer.model.config.vocab_size)
    update(trainer, batch, loss_fn, spec)
    policy = trainer.compute_log_probs(batch, 1.0)
    trainer.save_checkpoint(str(tmp_path / "ckpt"))

    def log_probs(model):  # a plain model, or peft's, computing as the trainer does (unsharded: hf's pass)
        scratch = HFTrainStrategy.__new__(HFTrainStrategy)
        scratch.__dict__.update(trainer.__dict__, model=model.eval())
        return scratch.compute_log_probs(batch, 1.0)

    plain = load_causal_lm(str(tmp_path / "ckpt" / "model"))
    assert not any(".lora_" in n for n, _ in plain.named_parameters())
    torch.testing.assert_close(log_probs(plain), policy, atol=1e-5, rtol=0)  # the merged save
    adapter = PeftModel.from_pretrained(load_causal_lm(str(tiny_model_path)), str(tmp_path / "ckpt" / "adapter"))
    torch.testing.assert_close(log_probs(adapter), policy, atol=1e-6, rtol=0)  # peft loads the adapter
    assert json.loads((tmp_path / "ckpt" / "adapter" / "adapter_config.json").read_text())["inference_mode"]

    update(trainer, batch, loss_fn, spec)
    resumed = FSDP2TrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=1)  # other fresh adapters
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    update(resumed, batch, loss_fn, spec)
    expected = full_weights(trainer)
    for name, value in full_weights(resumed).items():  # adapters and Adam moments resumed bit for bit
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0, msg=name)

    policy = trainer.compute_log_probs(batch, 1.0)
    trainer.export_model(str(tmp_path / "warm"))
    torch.testing.assert_close(log_probs(load_causal_lm(str(tmp_path / "warm"))), policy, atol=1e-5, rtol=0)
    trainer.fold_adapters(str(tmp_path / "warm"))
    torch.testing.assert_close(trainer.compute_log_probs(batch, 1.0), policy, atol=1e-5, rtol=0)
    torch.testing.assert_close(trainer.base_log_probs(batch, 1.0), policy, atol=1e-5, rtol=0)  # the new base
    weights = full_weights(trainer)
    assert all(float(t.abs().max()) == 0 for n, t in weights.items() if n.endswith(".lora_B"))
    assert all(float(t.abs().max()) > 0 for n, t in weights.items() if n.endswith(".lora_A"))  # fresh, drawn


def _lora_on_two_ranks(rank: int, port: int, model_path: str, out_dir: str) -> None:
    """Rank ``rank`` of 2: update, checkpoint, update; a strategy of another seed resumes and updates;
    then export and fold. What each step gave is saved for the test."""
    from roll_core.algorithms.objective import ActorObjective
    from roll_core.runtime import distributed
    from roll_core.strategies.fsdp2 import FSDP2TrainStrategy
    from roll_core.testing import full_weights, training_batch
    from roll_core.training import UpdateSpec, update

    torch.set_num_threads(1)
    distributed.init_data_parallel(("127.0.0.1", port), rank, 2, timeout_s=120)
    cfg = load_config(None, LORA + ["roles.actor_train.num_workers=2", "executor=ray"])
    loss_fn = ActorObjective.from_config(cfg.algorithm, cfg.rollout)
    spec = UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train)
    trainer = FSDP2TrainStrategy(model_path, cfg.roles.actor_train, seed=0)
    batch = training_batch(trainer.model.config.vocab_size)
    update(trainer, batch, loss_fn, spec)
    trainer.save_checkpoint(f"{out_dir}/ckpt")
    update(trainer, batch, loss_fn, spec)
    got = {"expected": full_weights(trainer)}  # every rank gathers; rank 0 keeps what it sends
    resumed = FSDP2TrainStrategy(model_path, cfg.roles.actor_train, seed=1)
    resumed.load_checkpoint(f"{out_dir}/ckpt")
    update(resumed, batch, loss_fn, spec)
    got["resumed"] = full_weights(resumed)
    got["policy"] = trainer.compute_log_probs(batch, 1.0)
    trainer.export_model(f"{out_dir}/warm")
    trainer.fold_adapters(f"{out_dir}/warm")
    got["folded"] = trainer.compute_log_probs(batch, 1.0)
    got["base"] = trainer.base_log_probs(batch, 1.0)
    got["fresh"] = full_weights(trainer)
    update(trainer, batch, loss_fn, spec)
    trainer.save_checkpoint(f"{out_dir}/after_fold")  # its adapter names the folded base
    on_tiny = FSDP2TrainStrategy(model_path, cfg.roles.actor_train, seed=1)
    on_tiny.load_checkpoint(f"{out_dir}/after_fold")  # loads the folded base under the adapters
    got["after_fold"], got["after_fold_resumed"] = (s.compute_log_probs(batch, 1.0) for s in (trainer, on_tiny))
    got["shard"] = next(p for n, p in trainer.model.named_parameters() if ".lora_A." in n).to_local().shape
    torch.save(got, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


def test_lora_under_two_fsdp2_ranks_resumes_exports_and_folds(tiny_model_path, tmp_path):
    pytest.importorskip("peft")
    from roll_core.runtime.distributed import node_address
    from roll_core.strategies.models import load_causal_lm

    mp.spawn(_lora_on_two_ranks, args=(node_address()[1], str(tiny_model_path), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in (0, 1)]
    assert ranks[0]["shard"] == (4, 128)  # rank 8 split over two ranks: every adapter is sharded
    assert not (tmp_path / "ckpt" / "model").exists()  # save: adapter (the default) writes no full model
    assert ranks[1]["expected"] == {} and ranks[0]["expected"]  # rank 0 sends for both
    for name, value in ranks[0]["expected"].items():  # adapters and Adam moments resumed bit for bit
        torch.testing.assert_close(ranks[0]["resumed"][name], value, atol=0, rtol=0, msg=name)
    for got in ranks:
        torch.testing.assert_close(got["folded"], got["policy"], atol=1e-5, rtol=0)
        torch.testing.assert_close(got["base"], got["policy"], atol=1e-5, rtol=0)  # the fold is the new base
        torch.testing.assert_close(got["after_fold_resumed"], got["after_fold"], atol=1e-6, rtol=0)
    exported = load_causal_lm(str(tmp_path / "warm"))
    assert not any(".lora_" in n for n, _ in exported.named_parameters())
    fresh = ranks[0]["fresh"]
    assert all(float(t.abs().max()) == 0 for n, t in fresh.items() if n.endswith(".lora_B"))
    drawn = [t for n, t in fresh.items() if n.endswith(".lora_A")]
    assert drawn and all(not torch.equal(t[:4], t[4:]) for t in drawn)  # drawn whole, not one shard's draw twice


CRITIC = ["executor=local", "algorithm.advantage_estimator=gae", "roles.critic.strategy=fsdp2",
          "algorithm.ppo_epochs=2", "algorithm.ppo_mini_batch_size=4", "roles.critic.micro_batch_size=2"]


@pytest.mark.parametrize("images, adapters", [(False, False), (True, False), (False, True)],
                         ids=["text", "image-text", "lora"])
def test_the_critic_shards_its_units_and_computes_saves_and_resumes_what_hf_does(images, adapters, request, tmp_path,
                                                                               process_group):
    """roles.critic on fsdp2 (one rank): every decoder layer an FSDP unit; the hf critic's values,
    one update's metrics and values after; no unit left gathered by a pass without gradient; model/
    is a value model the hf critic loads; the checkpoint resumes the next update bit for bit. The
    same for the image-text model's critic on image prompts, and for a LoRA critic (whose trained
    head is in the root unit: a root left gathered made its checkpoint fail)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from roll_core.strategies.compiled import decoder_layers
    from roll_core.strategies.fsdp2 import FSDP2CriticStrategy
    from roll_core.strategies.hf import HFCriticStrategy
    from roll_core.testing import critic_update, hf_role, image_training_batch, training_batch

    if adapters:
        pytest.importorskip("peft")
    tiny_model_path = request.getfixturevalue("tiny_vlm_path" if images else "tiny_model_path")
    cfg = load_config(None, CRITIC + (["roles.critic.lora={rank: 4, alpha: 8, save: merged}"] if adapters else []))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # every warning, whatever an earlier test already showed
        critic = FSDP2CriticStrategy(str(tiny_model_path), cfg.roles.critic, seed=3)
        assert all(isinstance(m, FSDPModule) for m in decoder_layers(critic.model) + [critic.model])
        reference = HFCriticStrategy(str(tiny_model_path), hf_role(cfg.roles.critic), seed=3)
        batch = image_training_batch(tiny_model_path) if images else training_batch(reference.model.config.vocab_size)
        torch.testing.assert_close(critic.compute_values(batch), reference.compute_values(batch), atol=1e-6, rtol=0)
        ours, theirs = critic_update(critic, cfg, batch), critic_update(reference, cfg, batch)
    # the value head's output is a view: FSDP2's warning about in-place writes on it does not apply to roll
    assert [str(w.message) for w in seen if "view tensor" in str(w.message)] == []
    for key in ("critic/value_loss", "critic/abs_error", "critic/grad_norm"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key
    after = reference.compute_values(batch)
    torch.testing.assert_close(critic.compute_values(batch), after, atol=1e-5, rtol=0)
    assert all(isinstance(p, DTensor) for p in critic.model.parameters())  # the root unit resharded too

    critic.save_checkpoint(str(tmp_path / "ckpt"))
    plain = hf_role(cfg.roles.critic).model_copy(update={"lora": None})
    exported = HFCriticStrategy(str(tmp_path / "ckpt" / "model"), plain, seed=4)
    torch.testing.assert_close(exported.compute_values(batch), after, atol=1e-5, rtol=0)
    critic_update(critic, cfg, batch)
    resumed = FSDP2CriticStrategy(str(tiny_model_path), cfg.roles.critic, seed=4)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    critic_update(resumed, cfg, batch)
    assert torch.equal(resumed.compute_values(batch), critic.compute_values(batch))


def _critic_on_two_ranks(rank: int, port: int, model_path: str, out_dir: str) -> None:
    """Rank ``rank`` of 2: one update on its share of every mini-batch (as the pipeline deals the
    batch out), then a checkpoint."""
    from roll_core.data import dp_shards
    from roll_core.runtime import distributed
    from roll_core.strategies.fsdp2 import FSDP2CriticStrategy
    from roll_core.testing import critic_update, training_batch

    torch.set_num_threads(1)
    distributed.init_data_parallel(("127.0.0.1", port), rank, 2, timeout_s=120)
    cfg = load_config(None, CRITIC + ["roles.critic.num_workers=2", "executor=ray"])
    critic = FSDP2CriticStrategy(model_path, cfg.roles.critic, seed=3)
    batch = training_batch(critic.model.config.vocab_size)
    metrics = critic_update(critic, cfg, dp_shards(batch, 2, cfg.algorithm.ppo_mini_batch_size)[rank])
    shard = next(p for p in critic.model.parameters() if p.dim() == 2).to_local().shape
    torch.save({"metrics": metrics, "values": critic.compute_values(batch), "shard": shard}, f"{out_dir}/{rank}.pt")
    critic.save_checkpoint(f"{out_dir}/ckpt")
    dist.destroy_process_group()


def test_the_critic_on_two_fsdp2_ranks_trains_as_one_hf_critic_on_the_whole_batch(tiny_model_path, tmp_path):
    from roll_core.runtime.distributed import node_address
    from roll_core.strategies.hf import HFCriticStrategy
    from roll_core.testing import critic_update, hf_role, training_batch

    mp.spawn(_critic_on_two_ranks, args=(node_address()[1], str(tiny_model_path), str(tmp_path)), nprocs=2, join=True)
    cfg = load_config(None, CRITIC)
    reference = HFCriticStrategy(str(tiny_model_path), hf_role(cfg.roles.critic), seed=3)
    batch = training_batch(reference.model.config.vocab_size)
    expected = critic_update(reference, cfg, batch)
    after = reference.compute_values(batch)
    ranks = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in (0, 1)]
    for got in ranks:
        assert got["shard"][0] * 2 == dict(reference.model.named_parameters())["model.embed_tokens.weight"].shape[0]
        for key in ("critic/value_loss", "critic/abs_error", "critic/grad_norm"):
            assert got["metrics"][key] == pytest.approx(expected[key], rel=1e-4), key
        torch.testing.assert_close(got["values"], after, atol=1e-5, rtol=0)
    exported = HFCriticStrategy(str(tmp_path / "ckpt" / "model"), hf_role(cfg.roles.critic), seed=4)
    torch.testing.assert_close(exported.compute_values(batch), after, atol=1e-5, rtol=0)


def test_fsdp2_trains_an_image_text_model_as_hf_does(tiny_vlm_path, process_group):
    """The tiny model with its vision tower: FSDP2 units are the decoder's and the encoder's layers,
    and the image prompts' log-probs, metrics and updated weights (the vision tower's too) are hf's."""
    from torch.distributed.fsdp import FSDPModule

    from roll_core.strategies.fsdp2 import FSDP2TrainStrategy
    from roll_core.strategies.hf import HFTrainStrategy
    from roll_core.testing import assert_trainer_matches_hf, hf_role, image_training_batch

    cfg = load_config(None, ["executor=local", "roles.actor_train.strategy=fsdp2", "algorithm.kl_loss_coef=0.1",
                             "algorithm.ppo_mini_batch_size=4", "roles.actor_train.micro_batch_size=2"])
    sharded = FSDP2TrainStrategy(str(tiny_vlm_path), cfg.roles.actor_train, seed=0)
    reference = HFTrainStrategy(str(tiny_vlm_path), hf_role(cfg.roles.actor_train), seed=0)
    units = {type(m).__name__ for m in sharded.model.modules() if isinstance(m, FSDPModule)}
    assert {"FSDPLlamaDecoderLayer", "FSDPSiglipEncoderLayer"} <= units
    assert_trainer_matches_hf(sharded, reference, cfg, log_prob_atol=1e-6, weight_atol=1e-6,
                              batch=image_training_batch(tiny_vlm_path))
