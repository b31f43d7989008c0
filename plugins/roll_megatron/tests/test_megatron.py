"""roll-megatron on the real Megatron-Core (on CPU processes over gloo here).

What must hold: the Hugging Face <-> Megatron conversion is a lossless round trip for every
tensor-parallel split; on the tiny model and a fixed batch, TP=1, TP=2, PP=2 and two data-parallel
replicas give the ``hf`` strategy's log-probs (fp32, within 1e-4) and, after one core update, its
weights and metrics; a checkpoint resumes exactly; the parallel layout is checked by ``roll
validate`` before any worker starts. The critic gives the ``hf`` critic's values, update and
checkpoint on one rank, at TP=2 and at PP=2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from roll_core.algorithms.objective import ActorObjective
from roll_core.config import load_and_check, load_config
from roll_core.errors import ConfigError
from roll_core.strategies import lora
from roll_core.strategies.hf import HFCriticStrategy, HFTrainStrategy
from roll_core.testing import (assert_checkpoint_resumes_exactly, assert_registered_lazily, assert_trainer_matches_hf,
                               assert_run_survives_a_killed_worker, critic_update, data_parallel_update, full_weights,
                               grouped_training_batch, hf_role, training_batch)
from roll_core.training import UpdateSpec, update

pytest.importorskip("megatron.core", reason="roll-megatron's tests need megatron-core: pip install roll-megatron")

from roll_megatron.convert import Layout  # noqa: E402
from roll_megatron.model import transformer_config  # noqa: E402

# Two PPO epochs of two mini-batches each, micro-batches of 2, clipping active, KL and entropy terms.
UPDATE = ["algorithm.ppo_epochs=2", "algorithm.ppo_mini_batch_size=4", "algorithm.kl_loss_coef=0.1",
          "algorithm.entropy_coef=0.01", "algorithm.max_grad_norm=0.5", "roles.actor_train.micro_batch_size=2"]


@pytest.fixture(scope="module")
def qwen2_gqa_path(tmp_path_factory):
    """A tiny Qwen2: grouped-query attention (4 query heads, 2 key/value heads), q/k/v biases,
    untied embeddings, so the conversion's other cases are exercised too."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=98, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)  # non-zero, so a misplaced bias shows
    path = tmp_path_factory.mktemp("qwen2") / "model"
    model.save_pretrained(path)
    return path


def _megatron_names(layers: int, qkv_bias: bool, tied: bool) -> list[str]:
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    names += [] if tied else ["output_layer.weight"]
    for i in range(layers):
        names += [f"decoder.layers.{i}.{n}" for n in (
            "input_layernorm.weight", "pre_mlp_layernorm.weight", "self_attention.linear_qkv.weight",
            "self_attention.linear_proj.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")]
        names += [f"decoder.layers.{i}.self_attention.linear_qkv.bias"] if qkv_bias else []
    return names


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_conversion_is_a_lossless_round_trip(qwen2_gqa_path, tp):
    from transformers import AutoConfig

    from roll_megatron.strategy import hf_tensors

    hf_config = AutoConfig.from_pretrained(qwen2_gqa_path)
    tensors = hf_tensors(str(qwen2_gqa_path))
    if tp > hf_config.num_key_value_heads:
        with pytest.raises(ValueError, match="tensor_parallel_size 4 must divide the model's num_key_value_heads"):
            transformer_config(hf_config, torch.float32, tp, 1)
        return
    config = transformer_config(hf_config, torch.float32, tp, 1)
    layouts = [Layout(config, rank, tp, layer_offset=0) for rank in range(tp)]
    back = {}
    for name in _megatron_names(2, qkv_bias=True, tied=False):
        shards = [layout.to_megatron(name, tensors.__getitem__) for layout in layouts]
        if tp > 1 and layouts[0].is_split(name):
            assert not torch.equal(shards[0], shards[1])  # really split, not copied
        back.update(layouts[0].to_hf(name, shards))
    assert back.keys() == tensors.keys()
    for name, value in tensors.items():
        assert torch.equal(back[name], value), name


def test_the_query_groups_land_where_megatron_reads_them(qwen2_gqa_path):
    """``linear_qkv`` holds each group's query heads, then its key and value head."""
    from transformers import AutoConfig

    from roll_megatron.strategy import hf_tensors

    config = transformer_config(AutoConfig.from_pretrained(qwen2_gqa_path), torch.float32, 1, 1)
    tensors = hf_tensors(str(qwen2_gqa_path))
    qkv = Layout(config, 0, 1, 0).to_megatron("decoder.layers.1.self_attention.linear_qkv.weight", tensors.__getitem__)
    d = 16  # head_dim = 64 / 4; 2 query heads per group
    q, k = tensors["model.layers.1.self_attn.q_proj.weight"], tensors["model.layers.1.self_attn.k_proj.weight"]
    torch.testing.assert_close(qkv[0:2 * d], q[0:2 * d])  # group 0: query heads 0-1
    torch.testing.assert_close(qkv[2 * d:3 * d], k[0:d])  # then key head 0
    torch.testing.assert_close(qkv[4 * d:6 * d], q[2 * d:4 * d])  # group 1: query heads 2-3


def _compare_with_hf(model_path: str, tp: int, pp: int, world: int, distributed_optimizer: bool = False):
    overrides = UPDATE + ["executor=ray"]
    one = load_config(None, overrides)
    reference = HFTrainStrategy(model_path, hf_role(one.roles.actor_train), seed=0)
    batch = training_batch(reference.model.config.vocab_size)
    mask = batch["response_mask"]
    before = reference.compute_log_probs(batch, 1.0)
    expected_metrics = update(reference, batch, ActorObjective.from_config(one.algorithm, one.rollout),
                              UpdateSpec.from_config(one.algorithm, one.roles.actor_train))
    expected = full_weights(reference)
    after = reference.compute_log_probs(batch, 1.0)

    cfg = load_config(None, overrides + [
        "roles.actor_train.strategy=megatron", f"roles.actor_train.num_workers={world}",
        f"roles.actor_train.strategy_options={{tensor_parallel_size: {tp}, pipeline_parallel_size: {pp}, "
        f"distributed_optimizer: {str(distributed_optimizer).lower()}}}"])
    metrics, sent, log_probs = data_parallel_update(model_path, cfg, batch, world)
    weights = {}
    for rank in sent:
        assert not set(rank) & set(weights), "a weight was sent by two ranks"
        weights.update(rank)
    assert weights.keys() == expected.keys(), sorted(set(weights) ^ set(expected))
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, atol=1e-5, rtol=1e-4, msg=name)
    for rank_log_probs in log_probs:  # every rank answers, with the updated weights
        torch.testing.assert_close(rank_log_probs * mask, after * mask, atol=1e-4, rtol=0)
        assert float(((rank_log_probs - before) * mask).abs().max()) > 1e-3
    for key in ("train/pg_loss", "train/kl", "train/entropy", "train/grad_norm"):
        assert metrics[0][key] == pytest.approx(expected_metrics[key], rel=1e-4, abs=1e-6), key
    return metrics


@pytest.mark.ray
@pytest.mark.parametrize("tp, pp, world, distributed_optimizer",
                         [(1, 1, 1, False), (2, 1, 2, False), (1, 2, 2, False), (1, 1, 2, False), (1, 1, 2, True)],
                         ids=["tp1", "tp2", "pp2", "dp2", "dp2-distributed-optimizer"])
def test_each_layout_computes_what_hf_computes(tiny_model_path, tp, pp, world, distributed_optimizer):
    _compare_with_hf(str(tiny_model_path), tp, pp, world, distributed_optimizer)


def test_one_rank_in_this_process_computes_what_hf_computes(tiny_model_path):
    """The ``local`` executor's case, and the one a single GPU checks: no Ray, one rank, the
    strategy and ``hf`` side by side (on CUDA and nccl where a GPU is present)."""
    from roll_core.testing import assert_trainer_matches_hf
    from roll_megatron.strategy import MegatronTrainStrategy

    cfg = load_config(None, UPDATE + ["roles.actor_train.strategy=megatron"])
    trainer = MegatronTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    reference = HFTrainStrategy(str(tiny_model_path), hf_role(cfg.roles.actor_train), seed=0)
    assert next(trainer.model.parameters()).device.type == reference.device.type
    assert_trainer_matches_hf(trainer, reference, cfg)


def test_bf16_trains_near_fp32_and_keeps_float32_weights_gradients_and_moments(tiny_model_path):
    """``precision: bf16`` (one rank, in process): float32 log-probs near fp32's and not equal (the
    products ran in bfloat16), an update near fp32's, float32 weights, gradients and AdamW moments,
    and no warning in the run's output."""
    import warnings

    from roll_megatron.strategy import MegatronTrainStrategy

    def trainer(precision: str) -> MegatronTrainStrategy:
        role = load_config(None, UPDATE + ["roles.actor_train.strategy=megatron",
                                           f"roles.actor_train.strategy_options.precision={precision}"]).roles.actor_train
        return MegatronTrainStrategy(str(tiny_model_path), role, seed=0)

    cfg = load_config(None, UPDATE)
    objective, spec = ActorObjective.from_config(cfg.algorithm, cfg.rollout), UpdateSpec.from_config(
        cfg.algorithm, cfg.roles.actor_train)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        half, full = trainer("bf16"), trainer("fp32")
        batch = training_batch(half.hf_config.vocab_size)
        mask = batch["response_mask"].bool()
        got, want = (s.forward(batch, ("log_probs", "entropy"), 1.0) for s in (half, full))
        for name in ("log_probs", "entropy"):
            assert got[name].dtype == torch.float32, name
            gap = float((got[name] - want[name])[mask].abs().max())
            assert 1e-4 < gap < 0.02, (name, gap)  # bfloat16: 8 bits of mantissa
        got, want = (update(s, batch, objective, spec) for s in (half, full))
    assert [str(w.message) for w in seen if "dtype" in str(w.message)] == []
    for key in ("train/pg_loss", "train/entropy", "train/grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=5e-3), key
    assert got["train/grad_norm"] != want["train/grad_norm"]
    assert {p.dtype for p in half.model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in half.model.parameters() if p.grad is not None} == {torch.float32}
    moments = [v for group in half.optimizers.values() for state in group.state.values() for v in state.values()
               if v.dim()]
    assert moments and {m.dtype for m in moments} == {torch.float32}


@pytest.mark.ray
def test_bf16_through_two_pipeline_stages_trains_near_fp32(tiny_model_path):
    """Under bf16 the hidden states and their gradients cross the stages in float32 (the stages'
    outputs are cast back), and the two stages' update is fp32's within bfloat16's error."""
    model_path = str(tiny_model_path)
    reference = HFTrainStrategy(model_path, hf_role(load_config(None, UPDATE).roles.actor_train), seed=0)
    batch = training_batch(reference.model.config.vocab_size)
    cfg = load_config(None, UPDATE)
    want = update(reference, batch, ActorObjective.from_config(cfg.algorithm, cfg.rollout),
                  UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train))
    cfg = load_config(None, UPDATE + ["executor=ray", "roles.actor_train.strategy=megatron",
                                      "roles.actor_train.num_workers=2",
                                      "roles.actor_train.strategy_options={pipeline_parallel_size: 2, precision: bf16}"])
    metrics, sent, _ = data_parallel_update(model_path, cfg, batch, 2)
    for key in ("train/pg_loss", "train/entropy", "train/grad_norm"):
        assert metrics[0][key] == metrics[1][key] == pytest.approx(want[key], rel=5e-3), key
    assert metrics[0]["train/grad_norm"] != want["train/grad_norm"]
    weights = {**sent[0], **sent[1]}
    for name, value in full_weights(reference).items():
        torch.testing.assert_close(weights[name], value, atol=2e-3, rtol=0, msg=name)


@pytest.mark.ray
def test_grouped_query_attention_with_biases_at_tp2(qwen2_gqa_path):
    _compare_with_hf(str(qwen2_gqa_path), 2, 1, 2)


@pytest.mark.ray
def test_a_reference_role_on_megatron_gives_hf_log_probs_per_replica(tiny_model_path):
    """roles.reference on megatron, 4 workers as TP=2 x DP=2, spawned and grouped by the pipeline's
    own RoleGroups: each replica gets half the batch, and the log-probs are hf's."""
    import ray

    from roll_core.pipelines.runtime import RoleGroups, log_probs
    from roll_core.plugins import get_plugins
    from roll_core.runtime.executor import RayExecutor

    cfg = load_and_check(None, ["executor=ray", "roles.reference.strategy=megatron", "roles.reference.num_workers=4",
                                "roles.reference.strategy_options={tensor_parallel_size: 2}"])
    hf = HFTrainStrategy(str(tiny_model_path), hf_role(cfg.roles.actor_train), seed=0)
    batch = training_batch(hf.model.config.vocab_size)
    expected = hf.compute_log_probs(batch, 0.7)
    executor = RayExecutor(num_cpus=4, timeout_s=300)
    try:
        group = RoleGroups(cfg, executor, get_plugins()).model_role("reference", str(tiny_model_path),
                                                                    cfg.roles.reference)
        assert group.dp_ranks == [0, 0, 1, 1]
        got, _ = log_probs(executor, group, batch, 0.7)
    finally:
        executor.shutdown()
        ray.shutdown()
    mask = batch["response_mask"]
    torch.testing.assert_close(got * mask, expected * mask, atol=1e-4, rtol=0)


def test_a_checkpoint_resumes_exactly(tiny_model_path, tmp_path):
    from roll_megatron.strategy import MegatronTrainStrategy

    cfg = load_config(None, UPDATE + ["roles.actor_train.strategy=megatron"])
    assert_checkpoint_resumes_exactly(
        lambda seed: MegatronTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed), cfg, tmp_path / "ckpt")


def _sharded_optimizer_rank(rank: int, port: int, model_path: str, directory: str, out) -> None:
    """One of 2 data-parallel ranks with the distributed optimizer: update, save, update; a fresh
    strategy loads the checkpoint and must make the same second update."""
    import torch.distributed as dist

    from roll_megatron.strategy import MegatronTrainStrategy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg = load_config(None, UPDATE + ["roles.actor_train.strategy=megatron", "roles.actor_train.num_workers=2",
                                      "roles.actor_train.strategy_options={distributed_optimizer: true}"])
    loss_fn = ActorObjective.from_config(cfg.algorithm, cfg.rollout)
    spec = UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train)
    trainer = MegatronTrainStrategy(model_path, cfg.roles.actor_train, 0)
    batch = training_batch(trainer.hf_config.vocab_size).chunk(2)[rank]
    update(trainer, batch, loss_fn, spec)
    trainer.save_checkpoint(directory)
    update(trainer, batch, loss_fn, spec)
    expected = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    local = trainer.optimizers["default"].optim
    owned = {id(p) for group in local.param_groups for p in group["params"]}
    resumed = MegatronTrainStrategy(model_path, cfg.roles.actor_train, 1)
    resumed.load_checkpoint(directory)
    update(resumed, batch, loss_fn, spec)
    same = all(torch.equal(v, expected[k]) for k, v in resumed.model.named_parameters())
    out.put((rank, len(owned), len(list(trainer.model.parameters())), same, local.defaults["fused"]))
    dist.destroy_process_group()


def _spawn_two(target, *args):
    """``target(rank, *args, queue)`` in two spawned processes; what each put, sorted by rank."""
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = []
    while len(results) < 2:
        try:
            results.append(out.get(timeout=5))
        except queue.Empty:
            assert all(p.exitcode in (None, 0) for p in procs), "a rank failed (its traceback is above)"
    for p in procs:
        p.join(timeout=60)
    return sorted(results)


def test_the_distributed_optimizer_shards_its_states_and_resumes_exactly(tiny_model_path, tmp_path):
    port = 20000 + int(tmp_path.stat().st_ino) % 20000
    results = _spawn_two(_sharded_optimizer_rank, port, str(tiny_model_path), str(tmp_path / "ckpt"))
    (_, owned0, total, same0, fused0), (_, owned1, _, same1, fused1) = results
    assert owned0 + owned1 == total and 0 < owned0 < total  # each rank keeps states for its share only
    assert same0 and same1
    assert fused0 is True and fused1 is True  # each rank's share steps on torch's fused AdamW, as hf's


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_worker_restarts_the_run_from_a_megatron_checkpoint(tmp_path):
    assert_run_survives_a_killed_worker(tmp_path / "run", "roles.actor_train.strategy=megatron",
                                        "roles.actor_train.num_workers=2",
                                        "roles.actor_train.strategy_options={tensor_parallel_size: 2}")


LORA = ["roles.actor_train.lora={rank: 4, alpha: 8}"]
SOME = "roles.actor_train.lora.target_modules=[q_proj, v_proj, o_proj, up_proj]"  # parts of both fused layers


def _nonzero_b(reference):
    """``reference`` (an ``hf`` strategy under LoRA) with ``B`` drawn non-zero, so the adapters'
    products show in the first forward pass already."""
    with torch.no_grad():
        for name, param in reference.model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return reference


def _peft_policy(model_path: str, cfg) -> HFTrainStrategy:
    return _nonzero_b(HFTrainStrategy(model_path, hf_role(cfg.roles.actor_train), seed=0))


def _fresh_adapters(trainer) -> dict:
    """The trainer's adapters, whole, under peft's saved names (every rank gathers)."""
    from roll_megatron import lora as megatron_lora

    state = megatron_lora.adapter_state(trainer.model, trainer.layout, trainer._gather)
    return {k: v.clone() for k, v in state.items()}


def _megatron_with(model_path: str, cfg, adapters: dict, fresh: list | None = None):
    """A megatron trainer under LoRA holding ``adapters`` (peft's saved names); ``fresh`` gets the
    adapters it drew itself."""
    from roll_megatron import lora as megatron_lora
    from roll_megatron.strategy import MegatronTrainStrategy

    trainer = MegatronTrainStrategy(model_path, cfg.roles.actor_train, seed=0)
    if fresh is not None:
        fresh.append(_fresh_adapters(trainer))
    megatron_lora.load_adapter_state(trainer.model, trainer.layout, adapters)
    return trainer


def _assert_exports_and_folds_the_policy(trainer, batch, directory):
    """The merged export is the policy (a plain model with its log-probs), and after a fold the
    base with the adapters disabled is too."""
    mask = batch["response_mask"]
    policy = trainer.compute_log_probs(batch, 1.0) * mask
    trainer.export_model(str(directory))
    plain = load_config(None, UPDATE)
    exported = HFTrainStrategy(str(directory), plain.roles.actor_train, seed=0).compute_log_probs(batch, 1.0) * mask
    torch.testing.assert_close(exported, policy, atol=1e-5, rtol=0)
    assert float((trainer.base_log_probs(batch, 1.0) * mask - policy).abs().max()) > 1e-3  # the adapters count
    trainer.fold_adapters(str(directory))
    torch.testing.assert_close(trainer.compute_log_probs(batch, 1.0) * mask, policy, atol=1e-5, rtol=0)
    torch.testing.assert_close(trainer.base_log_probs(batch, 1.0) * mask, policy, atol=1e-5, rtol=0)
    assert trainer.lora_base == str(directory)


@pytest.mark.parametrize("targets", [[], [SOME]], ids=["all-linear", "some"])
def test_lora_trains_the_adapters_peft_trains(tiny_model_path, tmp_path, targets):
    """One rank: the fused layers' adapters (q, k, v in linear_qkv; gate, up in linear_fc1) compute,
    train and travel as peft's separate ones do, all targeted or some; the base log-probs are
    peft's with its adapters disabled; the merged export and the fold keep the policy."""
    cfg = load_config(None, UPDATE + LORA + targets)
    reference = _peft_policy(str(tiny_model_path), cfg)
    trainer = _megatron_with(str(tiny_model_path), cfg, lora.adapter_state(reference.model))
    assert_trainer_matches_hf(trainer, reference, cfg, weight_atol=1e-6)  # what a sync sends: the adapters
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    expected = 2 * trainer.hf_config.num_hidden_layers * (4 if targets else 7)  # A and B per projection
    assert len(trainable) == expected and all(".lora_" in n for n in trainable)
    batch = training_batch(trainer.hf_config.vocab_size)
    mask = batch["response_mask"]
    torch.testing.assert_close(trainer.base_log_probs(batch, 1.0) * mask, reference.base_log_probs(batch, 1.0) * mask,
                               atol=1e-4, rtol=0)
    _assert_exports_and_folds_the_policy(trainer, batch, tmp_path / "merged")


def test_a_checkpoint_of_other_adapters_is_refused(tiny_model_path, tmp_path):
    from roll_megatron.strategy import MegatronTrainStrategy

    some = load_config(None, UPDATE + LORA + [SOME])
    MegatronTrainStrategy(str(tiny_model_path), some.roles.actor_train, seed=0).save_checkpoint(str(tmp_path / "c"))
    every = MegatronTrainStrategy(str(tiny_model_path), load_config(None, UPDATE + LORA).roles.actor_train, seed=0)
    with pytest.raises(ValueError, match="its adapters are not this model's: missing .*k_proj"):
        every.load_checkpoint(str(tmp_path / "c"))
    config = tmp_path / "c" / "adapter" / "adapter_config.json"  # a base that is gone is named
    config.write_text(config.read_text().replace(str(tiny_model_path), str(tmp_path / "gone")))
    with pytest.raises(FileNotFoundError, match=f"trained on {tmp_path / 'gone'}, which holds no safetensors"):
        every.load_checkpoint(str(tmp_path / "c"))


LAYOUTS = {"tp2": "{tensor_parallel_size: 2}", "pp2": "{pipeline_parallel_size: 2}"}


def _two_ranks(layout: str) -> list[str]:
    return UPDATE + LORA + [SOME, "roles.actor_train.num_workers=2",
                            f"roles.actor_train.strategy_options={LAYOUTS[layout]}"]


def _lora_rank(rank: int, port: int, model_path: str, layout: str, directory: str, expected: dict, out) -> None:
    """One of 2 ranks (TP=2 or PP=2) under LoRA: log-probs, one update, the synced adapters and a
    checkpoint, against ``expected`` (the ``hf`` strategy's, computed on one process)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        cfg = load_config(None, _two_ranks(layout))
        fresh: list[dict] = []
        trainer = _megatron_with(model_path, cfg, expected["adapters"], fresh)
        drawn = all(torch.equal(v, expected["fresh"][k]) for k, v in fresh[0].items())  # as one rank draws them
        batch = training_batch(trainer.hf_config.vocab_size)
        mask = batch["response_mask"]
        same_before = torch.allclose(trainer.compute_log_probs(batch, 1.0) * mask, expected["before"], atol=1e-4)
        got = update(trainer, batch, ActorObjective.from_config(cfg.algorithm, cfg.rollout),
                     UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train))
        metrics = all(got[k] == pytest.approx(v, rel=1e-3, abs=1e-5) for k, v in expected["metrics"].items())
        sent = full_weights(trainer)  # TP: rank 0 sends, rank 1 gathers with it; PP: each its stage's
        adapters = all(torch.allclose(v, expected["sent"][k], atol=1e-6, rtol=1e-4) for k, v in sent.items())
        same_after = torch.allclose(trainer.compute_log_probs(batch, 1.0) * mask, expected["after"], atol=1e-4)
        trainer.save_checkpoint(directory)
        _assert_exports_and_folds_the_policy(trainer, batch, Path(directory).parent / "merged")
        out.put((rank, drawn, same_before, metrics, adapters, same_after, sorted(sent), len(fresh[0])))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_on_two_ranks_computes_and_saves_what_peft_does(qwen2_gqa_path, tmp_path, layout):
    """TP=2: column-parallel adapters split B by rows (q, k, v of each query group in place),
    row-parallel ones split A by columns. PP=2: each stage trains, sends and saves its layers'
    adapters. adapter/ is peft's format and peft loads it onto the base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from roll_megatron.strategy import MegatronTrainStrategy

    cfg = load_config(None, _two_ranks(layout))
    one_rank = load_config(None, UPDATE + LORA + [SOME])
    fresh = _fresh_adapters(MegatronTrainStrategy(str(qwen2_gqa_path), one_rank.roles.actor_train, seed=0))
    reference = _peft_policy(str(qwen2_gqa_path), cfg)
    batch = training_batch(reference.model.config.vocab_size)
    mask = batch["response_mask"]
    adapters = {k: v.clone() for k, v in lora.adapter_state(reference.model).items()}  # before the update
    expected = {"adapters": adapters, "fresh": fresh, "before": reference.compute_log_probs(batch, 1.0) * mask}
    metrics = update(reference, batch, ActorObjective.from_config(cfg.algorithm, cfg.rollout),
                     UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train))
    expected["metrics"] = {k: metrics[k] for k in ("train/pg_loss", "train/kl", "train/entropy", "train/grad_norm")}
    expected |= {"sent": full_weights(reference), "after": reference.compute_log_probs(batch, 1.0) * mask}
    port = 20000 + int(tmp_path.stat().st_ino) % 20000
    sent, drawn = [], 0
    for rank, *checks, names, fresh in _spawn_two(_lora_rank, port, str(qwen2_gqa_path), layout,
                                                  str(tmp_path / "ckpt"), expected):
        assert checks == [True, True, True, True, True], (rank, checks)
        sent, drawn = sent + names, drawn + fresh
    assert sorted(sent) == sorted(expected["sent"])  # every adapter, each from one rank
    assert drawn == len(expected["fresh"]) * (2 if layout == "tp2" else 1)
    saved = tmp_path / "ckpt" / "adapter"
    assert not (tmp_path / "ckpt" / "model").exists()  # save: adapter
    assert lora.base_path_of(saved) == str(qwen2_gqa_path)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qwen2_gqa_path), saved)
    for name, param in model.named_parameters():
        if ".lora_" in name:  # the updated adapters, under peft's own names
            torch.testing.assert_close(param, dict(reference.model.named_parameters())[name], atol=1e-6, rtol=1e-4)
    assert {n.split(".")[-4] for n, _ in model.named_parameters() if ".lora_A." in n} == {
        "q_proj", "v_proj", "o_proj", "up_proj"}


def test_a_lora_warm_up_folds_into_the_base_the_reference_and_the_engines_use(tmp_path):
    """The core's LoRA run on megatron (local executor): the warm-up's adapters fold into
    warm-model/ (exported merged), RL's reference is the base with the adapters disabled (KL 0 at
    the first step), the engine merges the synced adapters onto warm-model/, and a checkpoint
    resumes."""
    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.runtime.executor import LocalExecutor
    from roll_core.strategies.models import load_causal_lm
    from roll_core.trackers import read_metrics

    run = tmp_path / "run"
    cfg = load_config(None, [f"output_dir={run}", "executor=local", "warmup.steps=4", "warmup.lr=1e-2",
                             "roles.actor_train.strategy=megatron", "roles.actor_train.lora={rank: 8}",
                             "trainer.max_steps=2", "trainer.eval_every=0", "trainer.save_every=2",
                             "data.eval_size=16", "rollout.prompts_per_step=4", "trackers=[jsonl]",
                             "algorithm.kl_metric=true"])
    pipeline = RLVRPipeline(cfg, LocalExecutor())
    pipeline.run()
    first = next(r for r in read_metrics(run / "metrics.jsonl") if r["step"] == 1)
    assert first["train/kl"] == pytest.approx(0, abs=1e-6)
    warm = load_causal_lm(str(run / "warm-model"))
    (engine,) = pipeline.infer.handles
    assert engine.merger.model_path == str(run / "warm-model")
    trainer = pipeline.actor.handles[0].strategy
    batch = training_batch(warm.config.vocab_size)
    mask = batch["response_mask"]
    plain = HFTrainStrategy(str(run / "warm-model"), load_config(None, []).roles.actor_train, seed=0)
    torch.testing.assert_close(trainer.base_log_probs(batch, 1.0) * mask, plain.compute_log_probs(batch, 1.0) * mask,
                               atol=1e-5, rtol=0)
    saved = run / "checkpoints" / "step_000002" / "actor_train"
    assert lora.base_path_of(saved / "adapter") == str(run / "warm-model")
    held = torch.load(saved / "megatron" / "rank0.pt", weights_only=False)["model"]
    assert held and all(".lora_" in name for name in held)  # the frozen base is warm-model/, not copied
    resumed = type(trainer)(pipeline.model, cfg.roles.actor_train, seed=1)  # from the untrained model
    resumed.load_checkpoint(str(saved))  # the base the adapter names (the fold's), then the adapters
    for method in ("compute_log_probs", "base_log_probs"):
        torch.testing.assert_close(getattr(resumed, method)(batch, 1.0), getattr(trainer, method)(batch, 1.0),
                                   atol=0, rtol=0)
    assert resumed.lora_base == str(run / "warm-model")


@pytest.mark.parametrize("budget", [None, 12], ids=["micro-batches-of-2", "max-tokens-12"])
def test_packed_rows_compute_what_padded_rows_compute(tiny_model_path, budget):
    """pack_sequences (on unless set false): fewer positions than the padded rows, each response
    rotated by its own positions though it follows another in its row; log-probs, entropy, one
    update's metrics and every weight after it are the padded rows'. With max_tokens_per_micro_batch
    the micro-batches are sized by tokens and the update stays the same."""
    from roll_megatron.strategy import MegatronTrainStrategy

    results = []
    for pack in (True, False):
        overrides = UPDATE + ["roles.actor_train.strategy=megatron", f"roles.actor_train.pack_sequences={pack}"]
        overrides += [f"roles.actor_train.max_tokens_per_micro_batch={budget}"] if budget and pack else []
        cfg = load_and_check(None, overrides)
        trainer = MegatronTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
        batch = grouped_training_batch(trainer.hf_config.vocab_size)
        rows = trainer._rows(batch)
        assert (rows.packed is not None) == pack
        positions = rows.ids.numel()
        outputs = trainer.forward(batch, ("log_probs", "entropy"), 1.0)
        assert trainer.model.rotary_pos_emb.positions is None  # per-token positions for that pass only
        passes, make_rows = [], trainer._rows
        trainer._rows = lambda micro: passes.append(len(micro)) or make_rows(micro)
        metrics = update(trainer, batch, ActorObjective.from_config(cfg.algorithm, cfg.rollout),
                         UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train))
        results.append((positions, outputs, metrics, full_weights(trainer), passes))
    (packed_positions, packed, packed_metrics, packed_weights, packed_passes), (
        padded_positions, padded, metrics, weights, padded_passes) = results
    assert packed_positions < padded_positions
    widths = []
    for settings in ("{}", "{pack_max_length: 9}"):  # unset: packed; the widest sample is 9 tokens
        trainer.role_config = load_config(None, [f"roles.actor_train={settings}"]).roles.actor_train
        widths.append(type(trainer)._rows(trainer, batch).ids.shape[1])  # not the pass counter
    assert widths[1] == 9 < widths[0]
    assert padded_passes == [2] * 8  # 2 epochs x 2 mini-batches x micro-batches of 2
    assert (packed_passes == padded_passes) == (budget is None)  # else sized by tokens
    for name in ("log_probs", "entropy"):
        torch.testing.assert_close(packed[name], padded[name], atol=1e-5, rtol=0, msg=name)
    for key in ("train/pg_loss", "train/kl", "train/entropy", "train/grad_norm"):
        assert packed_metrics[key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
    for name, value in weights.items():
        torch.testing.assert_close(packed_weights[name], value, atol=1e-5, rtol=1e-4, msg=name)


def test_the_warm_ups_packed_demonstrations_score_as_under_hf(tiny_model_path):
    """warmup.packing's rows (examples side by side, positions restarting) are taken as they come:
    each example attends to itself only, as transformers does for hf, and the log-probs are hf's."""
    from roll_core.pipelines.batches import demonstration_batch, packed_demonstration_batch
    from roll_core.pipelines.runtime import load_tokenizer
    from roll_megatron.strategy import MegatronTrainStrategy

    rows = [{"prompt": "12+34=", "demonstration": "46"}, {"prompt": "1+1=", "demonstration": "2"},
            {"prompt": "99+1=", "demonstration": "100"}, {"prompt": "7+8=", "demonstration": "15"}]
    tokenizer = load_tokenizer(str(tiny_model_path))
    batch = packed_demonstration_batch(tokenizer, rows, max_length=16)
    assert batch["position_ids"].shape == (2, 16)  # two examples in each row
    cfg = load_and_check(None, ["roles.actor_train.strategy=megatron", "warmup.packing=true"])
    trainer = MegatronTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    reference = HFTrainStrategy(str(tiny_model_path), hf_role(cfg.roles.actor_train), seed=0)
    mask = batch["response_mask"]
    got, expected = (s.compute_log_probs(batch, 1.0) * mask for s in (trainer, reference))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    alone = demonstration_batch(tokenizer, rows[2:3])  # "99+1=" "100</s>", row 1's first example, on its own
    answer = got[1][mask[1].bool()][:4]  # row 1's targets: "100</s>", then "2</s>"
    torch.testing.assert_close(answer, trainer.compute_log_probs(alone, 1.0)[0], atol=1e-5, rtol=0)


CRITIC = UPDATE + ["algorithm.advantage_estimator=gae", "roles.critic.strategy=megatron",
                   "roles.critic.micro_batch_size=2"]
CRITIC_METRICS = ("critic/value_loss", "critic/abs_error", "critic/grad_norm")
# parts of both fused layers, as SOME; save: merged for model/ beside adapter/
CRITIC_LORA = CRITIC + ["roles.critic.lora={rank: 4, alpha: 8, save: merged, "
                        "target_modules: [q_proj, v_proj, o_proj, up_proj]}"]


def _peft_critic(model_path: str, cfg) -> HFCriticStrategy:
    return _nonzero_b(HFCriticStrategy(model_path, hf_role(cfg.roles.critic), seed=3))


def _hf_critic_values(model_path: str, cfg, batch, reference: HFCriticStrategy | None = None) -> dict:
    """The ``hf`` critic's (``reference``, else a fresh one) values for ``batch`` before and after one
    update, and that update's metrics."""
    reference = reference or HFCriticStrategy(model_path, hf_role(cfg.roles.critic), seed=3)
    before = reference.compute_values(batch)
    metrics = critic_update(reference, cfg, batch)
    after = reference.compute_values(batch)
    assert float((after - before).abs().max()) > 1e-3  # the update moved the values
    return {"before": before, "after": after, "metrics": {k: metrics[k] for k in CRITIC_METRICS}}


def test_the_critic_computes_saves_and_resumes_what_hf_does(tiny_model_path, tmp_path):
    """roles.critic on megatron, one rank in this process: the ``hf`` critic's head for the seed and
    its values; one update with its metrics and values after; ``model/`` is a value model the ``hf``
    critic loads with the trained head; the rank file resumes the next update bit for bit."""
    from roll_megatron.strategy import MegatronCriticStrategy

    cfg = load_config(None, CRITIC)
    critic = MegatronCriticStrategy(str(tiny_model_path), cfg.roles.critic, seed=3)
    assert not critic.model.share_embeddings_and_output_weights  # the tiny policy's tied embeddings
    batch = training_batch(critic.hf_config.vocab_size)
    expected = _hf_critic_values(str(tiny_model_path), cfg, batch)
    torch.testing.assert_close(critic.compute_values(batch), expected["before"], atol=1e-5, rtol=0)
    metrics = critic_update(critic, cfg, batch)
    for key, value in expected["metrics"].items():
        assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    torch.testing.assert_close(critic.compute_values(batch), expected["after"], atol=1e-5, rtol=0)

    critic.save_checkpoint(str(tmp_path / "ckpt"))
    config = json.loads((tmp_path / "ckpt" / "model" / "config.json").read_text())
    assert (config["architectures"], len(config["id2label"]), config["classifier_dropout"]) == (
        ["LlamaForTokenClassification"], 1, 0.0)  # as the hf critic writes it: one label, no dropout
    for strategy, role in ((HFCriticStrategy, hf_role(cfg.roles.critic)), (MegatronCriticStrategy, cfg.roles.critic)):
        exported = strategy(str(tmp_path / "ckpt" / "model"), role, seed=4)  # a value model: its trained head
        torch.testing.assert_close(exported.compute_values(batch), expected["after"], atol=1e-5, rtol=0)
    critic_update(critic, cfg, batch)
    resumed = MegatronCriticStrategy(str(tiny_model_path), cfg.roles.critic, seed=4)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    critic_update(resumed, cfg, batch)
    assert torch.equal(resumed.compute_values(batch), critic.compute_values(batch))


def test_a_lora_critic_trains_saves_and_resumes_what_the_hf_lora_critic_does(tiny_model_path, tmp_path):
    """roles.critic.lora on megatron, one rank: holding the ``hf`` LoRA critic's adapters (``B`` drawn
    non-zero) and head, the same values, update and values after; only the adapters and the head
    train; ``adapter/`` is peft's (the head under its own names) and peft loads it onto a value model;
    ``model/`` (``save: merged``) is a plain value model; the rank file resumes bit for bit."""
    from roll_core.testing import assert_critic_adapter_gives
    from roll_megatron import lora as megatron_lora
    from roll_megatron.strategy import MegatronCriticStrategy

    cfg = load_config(None, CRITIC_LORA)
    reference = _peft_critic(str(tiny_model_path), cfg)
    critic = MegatronCriticStrategy(str(tiny_model_path), cfg.roles.critic, seed=5)  # another fresh head
    megatron_lora.load_adapter_state(critic.model, critic.layout, lora.adapter_state(reference.model))
    trained = {n for n, p in critic.model.named_parameters() if p.requires_grad}
    assert {n for n in trained if ".lora_" not in n} == {"output_layer.weight", "output_layer.bias"}
    assert len(trained) == 2 + 2 * critic.hf_config.num_hidden_layers * 4  # A and B per targeted projection
    frozen = {n: p.detach().clone() for n, p in critic.model.named_parameters() if not p.requires_grad}
    batch = training_batch(critic.hf_config.vocab_size)
    expected = _hf_critic_values(str(tiny_model_path), cfg, batch, reference)
    torch.testing.assert_close(critic.compute_values(batch), expected["before"], atol=1e-5, rtol=0)
    metrics = critic_update(critic, cfg, batch)
    for key, value in expected["metrics"].items():
        assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    values = critic.compute_values(batch)
    torch.testing.assert_close(values, expected["after"], atol=1e-5, rtol=0)
    assert all(torch.equal(p, frozen[n]) for n, p in critic.model.named_parameters() if n in frozen)

    critic.save_checkpoint(str(tmp_path / "ckpt"))
    assert_critic_adapter_gives(tmp_path / "ckpt" / "adapter", str(tiny_model_path), batch, values)
    plain = HFCriticStrategy(str(tmp_path / "ckpt" / "model"), hf_role(load_config(None, CRITIC).roles.critic), 4)
    torch.testing.assert_close(plain.compute_values(batch), values, atol=1e-5, rtol=0)
    rank_file = torch.load(tmp_path / "ckpt" / "megatron" / "rank0.pt", weights_only=False)
    assert rank_file["model"].keys() == trained  # the adapters and the head, not the frozen base

    critic_update(critic, cfg, batch)
    resumed = MegatronCriticStrategy(str(tiny_model_path), cfg.roles.critic, seed=4)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    critic_update(resumed, cfg, batch)
    assert torch.equal(resumed.compute_values(batch), critic.compute_values(batch))


def test_a_bf16_critic_gives_float32_values_near_fp32s_and_trains_near_them(tiny_model_path):
    """The critic shares the policy's bf16 forward and backward: float32 values within bfloat16's
    error of fp32's (and not equal), an update near fp32's, float32 weights after it."""
    from roll_megatron.strategy import MegatronCriticStrategy

    def critic(precision: str) -> MegatronCriticStrategy:
        role = load_config(None, CRITIC + [f"roles.critic.strategy_options.precision={precision}"]).roles.critic
        return MegatronCriticStrategy(str(tiny_model_path), role, seed=3)

    cfg = load_config(None, CRITIC)
    half, full = critic("bf16"), critic("fp32")
    batch = training_batch(half.hf_config.vocab_size)
    got, want = half.compute_values(batch), full.compute_values(batch)
    gap = float((got - want).abs().max())
    assert got.dtype == torch.float32 and 1e-5 < gap < 0.05, gap
    got, want = critic_update(half, cfg, batch), critic_update(full, cfg, batch)
    for key in CRITIC_METRICS:
        assert got[key] == pytest.approx(want[key], rel=5e-3), key
    assert {p.dtype for p in half.model.parameters()} == {torch.float32}


def _critic_rank(rank: int, port: int, model_path: str, layout: str, directory: str, expected: dict, out) -> None:
    """One of 2 ranks (TP=2 or PP=2) of a megatron critic: values, one update and a checkpoint,
    against ``expected`` (the ``hf`` critic's, on one process)."""
    import torch.distributed as dist

    from roll_megatron.strategy import MegatronCriticStrategy

    from roll_megatron import lora as megatron_lora

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        base = CRITIC_LORA if "adapters" in expected else CRITIC
        cfg = load_config(None, [*base, "roles.critic.num_workers=2",
                                 f"roles.critic.strategy_options={LAYOUTS[layout]}"])
        critic = MegatronCriticStrategy(model_path, cfg.roles.critic, seed=3)
        if "adapters" in expected:  # the hf LoRA critic's (peft's names), this stage's part of them
            megatron_lora.load_adapter_state(critic.model, critic.layout, expected["adapters"])
        batch = training_batch(critic.hf_config.vocab_size)
        before = torch.allclose(critic.compute_values(batch), expected["before"], atol=1e-5, rtol=0)
        got = critic_update(critic, cfg, batch)
        metrics = all(got[k] == pytest.approx(v, rel=1e-4, abs=1e-6) for k, v in expected["metrics"].items())
        after = torch.allclose(critic.compute_values(batch), expected["after"], atol=1e-4, rtol=0)
        names = sorted(dict(critic.hf_parameters()))  # a collective: every rank calls it
        critic.save_checkpoint(directory)
        out.put((rank, before, metrics, after, names))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout, adapted", [("tp2", False), ("pp2", False), ("pp2", True)],
                         ids=["tp2", "pp2", "pp2-lora"])
def test_the_critic_on_two_ranks_computes_and_saves_what_hf_does(tiny_model_path, tmp_path, layout, adapted):
    """TP=2: the value head is whole on each rank and reads the same hidden states; PP=2: the last
    stage holds it, and the tied embeddings of the policy's checkpoint are not tied in a value
    model. Either way ``model/`` holds the whole updated critic. Under LoRA (PP=2) each stage
    trains its layers' adapters, the last its head too, and ``adapter/`` holds every stage's."""
    cfg = load_config(None, CRITIC_LORA if adapted else CRITIC)
    reference = _peft_critic(str(tiny_model_path), cfg) if adapted else None
    batch = training_batch(HFCriticStrategy(str(tiny_model_path), hf_role(cfg.roles.critic), 0).model.config.vocab_size)
    # before the reference's update (copies: on the CPU adapter_state gives the live tensors)
    saved = {k: v.clone() for k, v in lora.adapter_state(reference.model).items()} if reference else None
    expected = _hf_critic_values(str(tiny_model_path), cfg, batch, reference)
    if saved is not None:
        expected["adapters"] = saved
    port = 20000 + int(tmp_path.stat().st_ino) % 20000
    names = []
    for rank, *checks, held in _spawn_two(_critic_rank, port, str(tiny_model_path), layout, str(tmp_path / "ckpt"),
                                          expected):
        assert checks == [True, True, True], (rank, checks)
        names.append(set(held))
    if layout == "pp2":  # each stage its own layers; the head on the last stage alone
        assert not names[0] & names[1] and {"score.weight", "score.bias"} <= names[1]
    exported = HFCriticStrategy(str(tmp_path / "ckpt" / "model"), hf_role(load_config(None, CRITIC).roles.critic),
                                seed=4)
    torch.testing.assert_close(exported.compute_values(batch), expected["after"], atol=1e-4, rtol=0)
    if adapted:
        from safetensors.torch import load_file

        adapter = load_file(str(tmp_path / "ckpt" / "adapter" / "adapter_model.safetensors"))
        assert adapter.keys() == saved.keys()  # both stages' adapters and the head


@pytest.mark.parametrize("overrides, message", [
    (["roles.actor_train.lora={dropout: 0.1}"],  # named by its own key, not the options'
     "default config: key 'roles.actor_train.lora.dropout': the megatron strategy trains LoRA without dropout "
     "(got 0.1"),
    (["algorithm.advantage_estimator=gae", "roles.critic.strategy=megatron", "roles.critic.lora={dropout: 0.1}"],
     "key 'roles.critic.lora.dropout': the megatron strategy trains LoRA without dropout (got 0.1"),
    (["roles.actor_train.strategy_options={tensor_paralel_size: 2}"],
     "unknown option 'tensor_paralel_size'. Did you mean 'tensor_parallel_size'?"),
    (["roles.actor_train.strategy_options={tensor_parallel_size: 3}", "roles.actor_train.num_workers=4"],
     "tensor_parallel_size 3 x pipeline_parallel_size 1 = 3 does not divide the role's 4 workers"),
    (["roles.actor_train.strategy_options={pipeline_parallel_size: 0}"],
     "roles.actor_train.strategy_options.pipeline_parallel_size"),
    (["roles.actor_infer.strategy=megatron"],
     "'megatron' computes log-probs only (for roles.reference) and cannot generate; strategies that generate: hf"),
    (["roles.reference.strategy=megatron", "roles.reference.num_workers=3",
      "roles.reference.strategy_options={tensor_parallel_size: 2}"],
     "key 'roles.reference.strategy_options': tensor_parallel_size 2 x pipeline_parallel_size 1 = 2 does not "
     "divide the role's 3 workers"),
])
def test_options_and_layout_are_checked_before_any_worker_starts(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_and_check(None, ["roles.actor_train.strategy=megatron", *overrides])
    assert message in str(err.value)


@pytest.mark.parametrize("kind", ["train", "infer", "critic"])
def test_the_plugin_registers_megatron_without_importing_it(kind):
    assert_registered_lazily(kind, "megatron", "megatron")


def test_a_bf16_reference_gives_float32_log_probs_near_fp32s(tiny_model_path):
    """The reference role shares the policy's forward (``_stage_forward``): under ``precision:
    bf16`` its log-probs are float32, within bfloat16's error of fp32's and not equal to them, and
    its frozen weights stay float32."""
    from roll_megatron.strategy import MegatronReferenceStrategy

    def reference(precision: str) -> MegatronReferenceStrategy:
        role = load_config(None, ["roles.reference.strategy=megatron",
                                  f"roles.reference.strategy_options.precision={precision}"]).roles.reference
        return MegatronReferenceStrategy(str(tiny_model_path), role, seed=0)

    half, full = reference("bf16"), reference("fp32")
    batch = training_batch(half.hf_config.vocab_size)
    got, want = half.compute_log_probs(batch, 0.7), full.compute_log_probs(batch, 0.7)
    mask = batch["response_mask"].bool()
    gap = float((got - want)[mask].abs().max())
    assert got.dtype == torch.float32 and 1e-4 < gap < 0.02, gap
    assert {p.dtype for p in half.model.parameters()} == {torch.float32}


def test_lora_under_bf16_trains_near_fp32_with_float32_adapters(tiny_model_path):
    """LoRA and ``precision: bf16`` together (one rank): the same adapters give an update within
    bfloat16's error of fp32's (and not equal), float32 adapters and gradients, and base log-probs
    (the adapters off) near fp32's."""
    adapters = lora.adapter_state(_peft_policy(str(tiny_model_path), load_config(None, UPDATE + LORA)).model)

    def trainer(precision: str):
        cfg = load_config(None, UPDATE + LORA + [f"roles.actor_train.strategy_options.precision={precision}"])
        return _megatron_with(str(tiny_model_path), cfg, adapters)

    cfg = load_config(None, UPDATE + LORA)
    objective, spec = ActorObjective.from_config(cfg.algorithm, cfg.rollout), UpdateSpec.from_config(
        cfg.algorithm, cfg.roles.actor_train)
    half, full = trainer("bf16"), trainer("fp32")
    batch = training_batch(half.hf_config.vocab_size)
    mask = batch["response_mask"].bool()
    gap = float((half.base_log_probs(batch, 1.0) - full.base_log_probs(batch, 1.0))[mask].abs().max())
    assert 1e-4 < gap < 0.02, gap
    got, want = update(half, batch, objective, spec), update(full, batch, objective, spec)
    for key in ("train/pg_loss", "train/entropy", "train/grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=5e-3), key
    assert got["train/grad_norm"] != want["train/grad_norm"]
    trained = [p for p in half.model.parameters() if p.requires_grad]
    assert trained and {p.dtype for p in trained} == {torch.float32}
    assert {p.grad.dtype for p in trained if p.grad is not None} == {torch.float32}
