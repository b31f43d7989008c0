"""Attention over packed rows piece by piece (:mod:`roll_core.strategies.packed_attention`): the plan
of a hand-packed batch, the same outputs and gradients as dense attention under the 4-D mask
(grouped-query heads too), and which passes take which path."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from roll_core.config.schema import TrainRoleConfig
from roll_core.strategies import packed_attention
from roll_core.strategies.hf import HFTrainStrategy
from roll_core.testing import grouped_training_batch

from conftest import packed_rows, two_prompt_groups

_attend_pieces = packed_attention._attend_pieces  # the real one, for spies that wrap it


def test_each_piece_gathers_its_prompt_and_itself():
    packed = packed_rows(two_prompt_groups())
    assert packed.input_ids.tolist() == [[5, 6, 7, 10, 11, 12], [8, 9, 13, 14, 15, 0]]
    # flat start, length, its prompt's flat start and length: A's prompt, its answers, B's prompt, its answer
    assert packed.pieces.tolist() == [[0, 3, 0, 0], [3, 2, 0, 3], [5, 1, 0, 3], [6, 2, 6, 0], [8, 3, 6, 2]]
    plan = packed_attention.attention_plan(packed.pieces, packed.tokens)
    # the prompts (2 pieces of up to 3 queries, keys their own); the answers longest first, cut where
    # one is half the group's longest: B's and A's first (3 queries, 3 prompt keys), then A's second
    assert plan.groups == [(2, 3, 3), (2, 3, 6), (1, 1, 4)]
    assert plan.queries.tolist() == [0, 1, 2, 6, 7, 7] + [8, 9, 10, 3, 4, 4] + [5]
    assert plan.keys.tolist() == [0, 1, 2, 6, 7, 7] + [6, 7, 7, 8, 9, 10, 0, 1, 2, 3, 4, 4] + [0, 1, 2, 5]
    prompts, answers, short = (mask[:, 0] for mask in plan.masks)
    assert answers[0, 2].tolist() == [True, True, False, True, True, True]  # token 15: B's prompt, 13, 14, itself
    assert answers[1, 0].tolist() == [True, True, True, True, False, False]  # token 10: A's prompt and itself
    assert answers[1, 2].tolist() == [True, True, True, True, True, False]  # past the piece's end: still keys
    assert short[0, 0].tolist() == [True, True, True, True]  # token 12: A's prompt and itself
    assert prompts[0, 1].tolist() == [True, True, False]  # a prompt: causal over itself
    assert prompts[1, 2].tolist() == [True, True, False]  # B's prompt has 2 tokens
    # each position's query slot; padding (position 11) takes any
    assert plan.slots.tolist() == [0, 1, 2, 9, 10, 12, 3, 4, 6, 7, 8, 0]
    assert plan.real_positions.flatten().tolist() == [1.0] * 11 + [0.0]
    assert plan.real_slots.flatten().tolist() == [1, 1, 1, 1, 1, 0] + [1, 1, 1, 1, 1, 0] + [1]
    additive = plan.to(torch.device("cpu"), torch.float32).masks[1][0, 0, 2]
    assert additive[2] == torch.finfo(torch.float32).min and additive[3] == 0.0
    half = plan.to(torch.device("cpu"), torch.bfloat16)  # a model in bfloat16 (DeepSpeed's bf16): its dtype
    assert {m.dtype for m in half.masks} == {half.real_slots.dtype, half.real_positions.dtype} == {torch.bfloat16}
    assert half.masks[1][0, 0, 2, 2] == torch.finfo(torch.bfloat16).min
    # answers of 4, 3 and 2 tokens after a 1-token prompt: 2 is half the longest, so it opens a group
    pieces = torch.tensor([[0, 1, 0, 0], [1, 4, 0, 1], [5, 2, 0, 1], [7, 3, 0, 1]])
    assert packed_attention.attention_plan(pieces, 10).groups == [(1, 1, 1), (2, 4, 5), (1, 2, 3)]


def test_pieces_only_where_rows_are_wide_and_dense_scores_many():
    def pays(pieces, width, device="cpu"):  # one row of pieces
        return packed_attention.pays_off(torch.tensor(pieces), rows=1, width=width, device=device)

    group = [[0, 6, 0, 0]] + [[6 + 48 * i, 48, 0, 6] for i in range(8)]  # a prompt of 6 and 8 answers of 48
    # dense: 400^2 = 160000 scores; pieces: 1 * 6 * 6 + 8 * 48 * 54 = 20772, 7.7x fewer
    assert pays(group, width=400)
    assert pays(group, width=256) and not pays(group, width=255)  # from MIN_WIDTH on, not under it
    # two rows of 256 and one piece of 256: dense computes exactly MIN_SAVING (2) times its scores, which pays
    assert packed_attention.pays_off(torch.tensor([[0, 256, 0, 0]]), rows=2, width=256, device="cpu")
    # a prompt of 250 and one answer of 48 in a row of 300: 250^2 + 48 * 298 = 76804 pieces' scores
    # against 90000 dense, not twice as few
    assert not pays([[0, 250, 0, 0], [250, 48, 0, 250]], width=300)
    # answers see their prompt: 120^2 + 4 * 34 * (120 + 34) = 35344 scores, more than half of 256^2
    prompt_heavy = [[0, 120, 0, 0]] + [[120 + 34 * i, 34, 0, 120] for i in range(4)]
    assert not pays(prompt_heavy, width=256)
    # a long-tailed row: one answer of 400 and 20 of 20. Padded alike, 21 * 400 * 410 scores, more than
    # dense's 1000^2; grouped by length, 10^2 + 400 * 410 + 20 * 20 * 30 = 176100
    tail = [[0, 10, 0, 0], [10, 400, 0, 10]] + [[410 + 20 * i, 20, 0, 10] for i in range(20)]
    assert pays(tail, width=1000)
    # the prompts are their own group: answers are not padded to a long prompt
    long_prompt = [[0, 200, 0, 0]] + [[200 + 10 * i, 10, 0, 200] for i in range(30)]  # 200^2 + 30 * 10 * 210
    assert pays(long_prompt, width=500)  # 103000 * 2 <= 250000
    # on a GPU, dense sdpa (fused) was never slower: every row attends densely there
    assert not pays(group, width=400, device=torch.device("cuda"))


@pytest.mark.parametrize("kv_heads, max_length", [(4, 1024), (2, 1024), (1, 12)])
def test_pieces_give_dense_attentions_outputs_and_gradients(kv_heads, max_length):
    """Random queries, keys and values on packed rows, 4 query heads over 4, 2 or 1 key/value heads;
    at 12 tokens per row a group's answers spread over rows, its prompt repeated in each."""
    packed = packed_rows(grouped_training_batch(), max_length)
    rows, width = packed.input_ids.shape
    dense_mask = packed.attention_mask("sdpa", torch.float32)
    plan = packed_attention.attention_plan(packed.pieces, packed.tokens).to(torch.device("cpu"), torch.float32)
    module = types.SimpleNamespace(training=False, num_key_value_groups=4 // kv_heads, is_causal=True)
    gen = torch.Generator().manual_seed(0)
    real = (packed.units >= 0)[:, :, None, None].float()
    weights = torch.randn(rows, width, 4, 8, generator=gen) * real  # the loss reads real positions only
    results = []
    for dense in (True, False):
        gen.manual_seed(1)
        q = torch.randn(rows, 4, width, 8, generator=gen).requires_grad_()
        k, v = (torch.randn(rows, kv_heads, width, 8, generator=gen).requires_grad_() for _ in range(2))
        if dense:
            out, _ = sdpa_attention_forward(module, q, k, v, dense_mask, scaling=0.3)
        else:
            out, _ = packed_attention.packed_attention(module, q, k, v, dense_mask, scaling=0.3,
                                                       **{packed_attention.PLAN_KEYWORD: plan})
        (out * weights).sum().backward()
        results.append((out * real, q.grad, k.grad, v.grad))
    for name, want, got in zip(("output", "query grad", "key grad", "value grad"), *results):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)
    assert float(results[0][2].abs().sum()) > 0.1  # the gradients compared are not zeros


def test_features_only_dense_attention_computes_run_dense():
    """A position bias (as T5-like models pass) is not the pieces' business: the call runs sdpa."""
    packed = packed_rows(two_prompt_groups())
    plan = packed_attention.attention_plan(packed.pieces, packed.tokens).to(torch.device("cpu"), torch.float32)
    mask = packed.attention_mask("sdpa", torch.float32)
    module = types.SimpleNamespace(training=False, num_key_value_groups=1, is_causal=True)
    q, k, v = (torch.randn(2, 2, 6, 4) for _ in range(3))
    bias = torch.randn(1, 2, 6, 6)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, position_bias=bias)
    got, _ = packed_attention.packed_attention(module, q, k, v, mask, position_bias=bias,
                                               **{packed_attention.PLAN_KEYWORD: plan})
    torch.testing.assert_close(got, want)


def test_a_packed_pass_attends_piece_by_piece_and_other_passes_stay_sdpa(tiny_model_path, monkeypatch,
                                                                         every_row_by_pieces):
    trainer = HFTrainStrategy(str(tiny_model_path), TrainRoleConfig(pack_sequences=True), seed=0)
    model = trainer.model
    ids = torch.tensor([[3, 4, 5, 6, 7], [0, 0, 8, 9, 10]], device=trainer.device)
    padded = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], device=trainer.device)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=padded).logits
    calls = []
    monkeypatch.setattr(packed_attention, "_attend_pieces",
                        lambda *args: calls.append(args[4]) or _attend_pieces(*args))
    trainer._outputs(grouped_training_batch(), ("log_probs",), temperature=1.0)
    assert model.config._attn_implementation == packed_attention.ATTENTION
    assert len(calls) == model.config.num_hidden_layers  # every layer got the plan
    with torch.no_grad():  # a pass without a plan (padded, generation) is sdpa's, bit for bit
        assert torch.equal(model(input_ids=ids, attention_mask=padded).logits, before)
    assert len(calls) == model.config.num_hidden_layers


def test_narrow_rows_attend_densely(tiny_model_path, monkeypatch):
    trainer = HFTrainStrategy(str(tiny_model_path), TrainRoleConfig(pack_sequences=True), seed=0)
    monkeypatch.setattr(packed_attention, "_attend_pieces", lambda *args: pytest.fail("narrow rows went by pieces"))
    trainer._outputs(grouped_training_batch(), ("log_probs",), temperature=1.0)
    assert trainer.model.config._attn_implementation == "sdpa"



def test_only_sdpa_models_that_pass_keywords_on_switch():
    class NoKeywords:
        def forward(self, input_ids, attention_mask=None):
            return input_ids

    class Keywords:
        def forward(self, input_ids, **kwargs):
            return input_ids

    for model, implementation, switched in ((NoKeywords(), "sdpa", False), (Keywords(), "eager", False),
                                            (Keywords(), "flash_attention_2", False), (Keywords(), "sdpa", True)):
        config = types.SimpleNamespace(_attn_implementation=implementation)
        assert packed_attention.adopt(model, config) is switched
        assert config._attn_implementation == (packed_attention.ATTENTION if switched else implementation)
        assert packed_attention.adopt(model, config) is switched  # a second call changes nothing
