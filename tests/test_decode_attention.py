"""A decoding step's attention on the CPU under bf16 autocast (roll_core.strategies.decode_attention):
float32 over a float32 KV cache, in place of autocast's bfloat16 attention over a cache it cast at
every step; nothing changes elsewhere (training passes, prefill, fp32 roles, GPUs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import roll_core.strategies.sequences as sequences
from roll_core.config.schema import InferRoleConfig
from roll_core.strategies import decode_attention, packed_attention
from roll_core.strategies.hf import HFInferStrategy
from roll_core.strategies.kv_cache import GrowingLayer
from roll_core.testing import left_padded_prompts

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


def test_other_passes_keep_sdpa_as_it_is():
    module, query, key, value, mask = _attention_inputs(queries=1)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain, _ = packed_attention.packed_attention(module, query, key, value.float(), mask, scaling=0.2)  # fp32 roles
    torch.testing.assert_close(plain, sdpa_attention_forward(module, query, key, value.float(), mask, scaling=0.2)[0],
                               atol=0, rtol=0)
    module, query, key, value, mask = _attention_inputs(queries=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a prefill or training pass: autocast's attention
        prefill, _ = packed_attention.packed_attention(module, query, key, value, mask)
    assert prefill.dtype == torch.bfloat16
    assert not decode_attention.applies(torch.device("meta"))  # and only the CPU's autocast counts


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
    real_prefill, real_attend = sequences.prefill, decode_attention.attend
    monkeypatch.setattr(sequences, "prefill", lambda *a: caches.append(real_prefill(*a)) or caches[-1])
    monkeypatch.setattr(decode_attention, "attend", lambda *a, **k: steps.append(a[1].shape) or real_attend(*a, **k))
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
        assert decode_attention.cache_dtype(engine.model, CPU) is None  # sdpa's own attention would cast it back
    half = HFInferStrategy(str(tiny_model_path), InferRoleConfig(strategy_options={"precision": "bf16"}), seed=0)
    assert decode_attention.cache_dtype(half.model, CPU) is None  # outside autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert decode_attention.cache_dtype(half.model, CPU) == torch.float32
