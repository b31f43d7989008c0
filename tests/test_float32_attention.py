"""Attention on the CPU under bf16 autocast (roll_core.strategies.float32_attention): decoding steps in
float32 over a float32 KV cache, in place of autocast's bfloat16 attention over a cache it cast at
every step, and passes that record gradients in float32, piece by piece or dense; nothing changes
elsewhere (passes without gradients, fp32 roles, GPUs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import roll_core.strategies.sequences as sequences
from roll_core.algorithms.objective import ActorObjective
from roll_core.config.schema import AlgorithmConfig, CriticRoleConfig, InferRoleConfig, TrainRoleConfig
from roll_core.strategies import float32_attention, packed_attention
from roll_core.strategies.hf import HFCriticStrategy, HFInferStrategy, HFTrainStrategy
from roll_core.strategies.kv_cache import GrowingLayer
from roll_core.testing import grouped_training_batch, left_padded_prompts
from roll_core.training import UpdateSpec, update

from conftest import packed_rows

CPU = torch.device("cpu")
on_the_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the strategies put the model on the GPU, "
                                "where decoding steps keep autocast's attention")


def _attention_inputs(queries: int, keys: int = 7, seed: int = 0):
    """Grouped-query attention: 4 query heads, 2 key/value heads."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(3, 4, queries, 8, generator=g)
    key, value = (torch.randn(3, 2, keys, 8, generator=g) for _ in range(2))
    mask = torch.ones(3, 1, queries, keys, dtype=torch.bool)
    mask[1, :, :, :2] = False  # a left-padded row
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    return module, query, key, value.bfloat16(), mask  # values come out of their projection in bfloat16


def test_a_decoding_step_under_cpu_autocast_attends_in_float32():
    module, query, key, value, mask = _attention_inputs(queries=1)
    exact = F.scaled_dot_product_attention(query, key, value.float(), attn_mask=mask, scale=0.2,
                                           enable_gqa=True).transpose(1, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = packed_attention.packed_attention(module, query, key, value, mask, scaling=0.2)
        autocasts = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.2,
                                                   enable_gqa=True).transpose(1, 2)
    assert ours.dtype == torch.float32 and autocasts.dtype == torch.bfloat16
    torch.testing.assert_close(ours, exact, atol=1e-6, rtol=1e-6)
    assert float((autocasts.float() - exact).abs().max()) > 1e-4  # what it replaces rounds to bfloat16


def test_passes_without_gradients_keep_autocasts_attention():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, query, key, value, mask = _attention_inputs(queries=1)
    plain, _ = packed_attention.packed_attention(module, query, key, value.float(), mask, scaling=0.2)  # fp32 roles
    torch.testing.assert_close(plain, sdpa_attention_forward(module, query, key, value.float(), mask, scaling=0.2)[0],
                               atol=0, rtol=0)
    module, query, key, value, mask = _attention_inputs(queries=7)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # a prefill, log-probs for the loss
        prefill, _ = packed_attention.packed_attention(module, query, key, value, mask)
    assert prefill.dtype == torch.bfloat16
    assert not float32_attention.applies(query.to("meta"))  # and only the CPU's autocast counts


def _pieces_inputs(grad: bool):
    """Packed rows of grouped answers with a plan, 4 query heads over 2 key/value heads; the keys
    float32 and the values bfloat16, as a bf16 layer hands them over."""
    packed = packed_rows(grouped_training_batch(), 1024)
    rows, width = packed.input_ids.shape
    plan = packed_attention.attention_plan(packed.pieces, packed.tokens).to(CPU, torch.float32)
    g = torch.Generator().manual_seed(0)
    query = torch.randn(rows, 4, width, 8, generator=g).requires_grad_(grad)
    key = torch.randn(rows, 2, width, 8, generator=g).requires_grad_(grad)
    value = torch.randn(rows, 2, width, 8, generator=g).bfloat16().requires_grad_(grad)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    real = (packed.units >= 0)[:, :, None, None].float()
    return module, (query, key, value), packed.attention_mask("sdpa", torch.float32), plan, real


@pytest.mark.parametrize("by_pieces", [True, False])
def test_a_pass_that_records_gradients_attends_in_float32(by_pieces):
    """Piece by piece or dense: float32 outputs and gradients, those of float32 attention over the
    same inputs; without gradients the same pass stays in bfloat16."""
    module, inputs, mask, plan, real = _pieces_inputs(grad=True)
    keywords = {packed_attention.PLAN_KEYWORD: plan} if by_pieces else {}
    weights = torch.randn(real.shape[0], real.shape[1], 4, 8, generator=torch.Generator().manual_seed(1)) * real
    exact = [t.detach().float().requires_grad_() for t in inputs]
    want, _ = packed_attention.packed_attention(module, *exact, mask, scaling=0.3, **dict(keywords))
    (want * weights).sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = packed_attention.packed_attention(module, *inputs, mask, scaling=0.3, **dict(keywords))
        rounded, _ = packed_attention.packed_attention(module, *(t.bfloat16() for t in exact), mask, scaling=0.3,
                                                       **dict(keywords))  # bfloat16 inputs are cast up too
    assert got.dtype == rounded.dtype == torch.float32
    (got * weights).sum().backward()
    torch.testing.assert_close(got * real, want * real, atol=1e-6, rtol=1e-6)
    for name, ours, exact_input in zip(("query", "key", "value"), inputs, exact):
        assert ours.grad.dtype == ours.dtype  # each input's gradient in its own dtype
        tolerance = 1e-6 if ours.dtype == torch.float32 else 1e-2  # the value's, rounded to bfloat16 on the way back
        torch.testing.assert_close(ours.grad.float(), exact_input.grad, atol=tolerance, rtol=tolerance, msg=name)
    assert float(exact[1].grad.abs().sum()) > 0.1  # the gradients compared are not zeros
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert packed_attention.packed_attention(module, *inputs, mask, scaling=0.3,
                                                 **dict(keywords))[0].dtype == torch.bfloat16


def test_the_cache_holds_the_dtype_it_is_given_and_casts_what_is_written():
    keys, values = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4).bfloat16()
    layer = GrowingLayer(keys, values, limit=10, dtype=torch.float32)
    new_key, new_value = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4).bfloat16()
    got_keys, got_values = layer.update(new_key, new_value)
    assert got_keys.dtype == got_values.dtype == torch.float32
    assert torch.equal(got_values[..., :3, :], values.float())
    assert torch.equal(got_values[..., 3:, :], new_value.float())
    layer.reorder_cache(torch.tensor([1]))  # dropping a finished row keeps the dtype
    assert layer.values.dtype == torch.float32 and torch.equal(layer.values, got_values[1:])
    assert GrowingLayer(keys, values, limit=10).values.dtype == torch.bfloat16  # otherwise each keeps its own
    assert GrowingLayer(keys.bfloat16(), values.float(), limit=10, dtype=torch.float32).keys.dtype == torch.float32
    layer.reset()  # a new prompt after a reset is held in the same dtype
    assert layer.update(new_key.bfloat16(), new_value)[0].dtype == torch.float32


@on_the_cpu
def test_a_bf16_sampler_on_the_cpu_keeps_a_float32_cache_and_attends_in_float32(tiny_model_path, monkeypatch):
    engine = HFInferStrategy(str(tiny_model_path), InferRoleConfig(strategy_options={"precision": "bf16"}), seed=0)
    assert engine.model.config._attn_implementation == packed_attention.ATTENTION
    caches, steps = [], []
    real_prefill, real_attend = sequences.prefill, float32_attention.attend
    monkeypatch.setattr(sequences, "prefill", lambda *a: caches.append(real_prefill(*a)) or caches[-1])
    monkeypatch.setattr(float32_attention, "attend", lambda *a: steps.append(a[2].shape) or real_attend(*a))
    out = engine.generate(left_padded_prompts(rows=6), max_new_tokens=5, temperature=1.0, top_p=1.0)
    past, _ = caches[0]
    assert {(layer.keys.dtype, layer.values.dtype) for layer in past.layers} == {(torch.float32, torch.float32)}
    decoded = out["responses"].shape[1] - 1  # the first token comes from the prefill
    assert decoded > 0 and len(steps) == decoded * engine.model.config.num_hidden_layers
    assert all(shape[2] == 1 for shape in steps)  # decoding steps only: the prefill kept autocast's attention


@on_the_cpu
def test_fp32_roles_and_models_on_other_attention_are_left_alone(tiny_model_path):
    engine = HFInferStrategy(str(tiny_model_path), InferRoleConfig(), seed=0)
    assert engine.model.config._attn_implementation == "sdpa"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert float32_attention.cache_dtype(engine.model, CPU) is None  # sdpa's own attention would cast it back
    half = HFInferStrategy(str(tiny_model_path), InferRoleConfig(strategy_options={"precision": "bf16"}), seed=0)
    assert float32_attention.cache_dtype(half.model, CPU) is None  # outside autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert float32_attention.cache_dtype(half.model, CPU) == torch.float32


@on_the_cpu
def test_a_bf16_update_on_the_cpu_attends_in_float32_and_its_log_probs_do_not(tiny_model_path, monkeypatch):
    """The trainer's update: once per layer, in float32; its forward passes without gradients (the
    log-probs the loss starts from) keep autocast's attention. A bf16 value model attends alike."""
    trainer = HFTrainStrategy(str(tiny_model_path), TrainRoleConfig(strategy_options={"precision": "bf16"}), seed=0)
    assert trainer.model.config._attn_implementation == packed_attention.ATTENTION
    calls = []
    real_attend = float32_attention.attend
    monkeypatch.setattr(float32_attention, "attend", lambda *a: calls.append(torch.is_grad_enabled()) or real_attend(*a))
    batch = grouped_training_batch()
    trainer.compute_log_probs(batch, 1.0)
    assert calls == []
    samples = len(batch)
    update(trainer, batch, ActorObjective.from_config(AlgorithmConfig()), UpdateSpec(max_grad_norm=1.0, micro_batch_size=samples))
    assert calls == [True] * trainer.model.config.num_hidden_layers
    critic = HFCriticStrategy(str(tiny_model_path), CriticRoleConfig(strategy_options={"precision": "bf16"}), seed=0)
    assert critic.model.config._attn_implementation == packed_attention.ATTENTION
    assert HFCriticStrategy(str(tiny_model_path), CriticRoleConfig(), seed=0).model.config._attn_implementation == "sdpa"
