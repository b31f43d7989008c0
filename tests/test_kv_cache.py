"""The sampler's in-place KV cache against transformers' concatenating one."""

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

import roll_core.strategies.sequences as sequences
from roll_core.strategies.kv_cache import GrowingLayer, in_place_cache


def _states(batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 4, generator=g), torch.randn(batch, 2, length, 4, generator=g)


def test_growing_layer_holds_what_concatenation_holds_through_reallocations_and_row_drops():
    plain, keys, values = DynamicLayer(), *_states(3, 5, 0)
    plain.update(keys, values)
    growing = GrowingLayer(keys, values, limit=5 + 40)
    assert growing._key_buffer.shape[-2] == 16  # twice the prompt, at least 16: not the whole limit at once
    capacities = set()
    for step in range(40):
        k, v = _states(plain.keys.shape[0], 1, step + 1)
        expected, got = plain.update(k, v), growing.update(k, v)
        assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
        assert growing.get_seq_length() == plain.get_seq_length() == 6 + step
        capacities.add(growing._key_buffer.shape[-2])
        if step in (3, 17):  # a row finishes: both keep the others, in the order given
            keep = torch.tensor([2, 0]) if step == 3 else torch.tensor([1])
            plain.reorder_cache(keep)
            growing.reorder_cache(keep)
            assert torch.equal(plain.keys, growing.keys) and torch.equal(plain.values, growing.values)
    assert capacities == {16, 32, 45}  # doubling, capped at the limit: a few copies, not one per step
    growing.crop(-3)
    plain.crop(-3)
    assert torch.equal(plain.keys, growing.keys) and growing.get_seq_length() == 42
    with pytest.raises(ValueError, match="negative"):
        growing.crop(1)


def test_dropping_rows_moves_only_the_rows_whose_place_changes_inside_the_same_buffers(monkeypatch):
    plain, keys, values = DynamicLayer(), *_states(5, 3, 0)
    plain.update(keys, values)
    growing = GrowingLayer(keys, values, limit=10)
    buffer = growing._key_buffer
    copied = []
    index_copy = torch.Tensor.index_copy_
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda t, dim, index, source: copied.append(index.tolist())
                        or index_copy(t, dim, index, source))
    # fill holes from the end; a swap (sources also targets); a reordering of every row; a cut
    for keep in ([0, 4, 2, 3], [3, 1, 0], [2, 1, 0], [0, 1]):
        plain.reorder_cache(torch.tensor(keep))
        growing.reorder_cache(torch.tensor(keep))
        assert torch.equal(plain.keys, growing.keys) and torch.equal(plain.values, growing.values)
    # keys and values each: only the rows that changed; none for the cut
    assert copied == [[1], [1], [0, 2], [0, 2], [0, 2], [0, 2]]
    assert growing._key_buffer is buffer and growing.keys.data_ptr() == buffer.data_ptr()  # nothing reallocated
    for step in range(10):  # the smaller batch decodes on, into the same buffers, then past their capacity
        k, v = _states(2, 1, step + 1)
        expected, got = plain.update(k, v), growing.update(k, v)
        assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    assert growing._key_buffer.shape[:1] == (2,)  # a reallocation keeps only the rows in use
    growing.reorder_cache(torch.tensor([1, 0, 1]))  # more rows than it holds: gathered into new buffers
    plain.reorder_cache(torch.tensor([1, 0, 1]))
    assert torch.equal(plain.keys, growing.keys) and growing.keys.shape[0] == 3


def test_growing_layer_writes_in_place_and_repeats_rows():
    growing = GrowingLayer(*_states(2, 3, 0), limit=10)
    buffer = growing._key_buffer
    growing.update(*_states(2, 1, 1))
    assert growing._key_buffer is buffer and growing.keys.data_ptr() == buffer.data_ptr()
    keys, values = growing.keys.clone(), growing.values.clone()
    growing.batch_repeat_interleave(2)
    assert torch.equal(growing.keys, keys.repeat_interleave(2, dim=0)) and growing.get_seq_length() == 4
    assert torch.equal(growing.values, values.repeat_interleave(2, dim=0))


def test_growing_layer_takes_more_than_its_limit_and_long_writes_at_once():
    plain, growing = DynamicLayer(), GrowingLayer(*_states(2, 3, 0), limit=4)
    plain.update(*_states(2, 3, 0))
    for length, seed in ((40, 1), (1, 2), (30, 3)):  # past the limit, and past twice what it holds
        k, v = _states(2, length, seed)
        expected, got = plain.update(k, v), growing.update(k, v)
        assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    assert growing.get_seq_length() == 74


def _zeroing_reset(layer):
    """transformers 5.17's layer reset (CacheLayerMixin's): the tensors zeroed in place, the layer
    left initialized. 5.24's DynamicLayer drops them instead."""
    if layer.is_initialized:
        layer.keys.zero_()
        layer.values.zero_()


@pytest.mark.parametrize("transformers_reset", ["installed", "zeroing"])
def test_growing_layer_crops_and_starts_again_after_a_reset(transformers_reset, monkeypatch):
    if transformers_reset == "zeroing":
        monkeypatch.setattr(DynamicLayer, "reset", _zeroing_reset)
    growing = GrowingLayer(*_states(2, 3, 0), limit=10)
    growing.crop(0)  # nothing to remove
    assert growing.get_seq_length() == 3
    growing.crop(-3)
    assert growing.get_seq_length() == 0 and growing.keys.shape[-2] == 0
    growing.reset()
    assert growing.get_seq_length() == 0 and growing.keys is None and not growing.is_initialized
    keys, values = _states(1, 2, 5)
    got = growing.update(keys, values)  # a new prompt, as into a fresh layer
    assert torch.equal(got[0], keys) and torch.equal(got[1], values) and growing.get_seq_length() == 2


def test_in_place_cache_swaps_only_plain_layers():
    cache = DynamicCache()
    cache.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=4), DynamicLayer()]
    keys, values = _states(2, 3, 0)
    cache.layers[0].update(keys, values)
    cache.layers[1].update(keys, values)  # the third stays empty (a layer that shares another's cache)
    in_place_cache(cache, new_tokens=8)
    assert [type(layer) for layer in cache.layers] == [GrowingLayer, DynamicSlidingWindowLayer, DynamicLayer]
    assert torch.equal(cache.layers[0].keys, keys) and cache.layers[0].limit == 11
    assert in_place_cache("not a cache", 8) == "not a cache"


def test_sampler_draws_the_same_tokens_with_either_cache(tiny_model_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    enc = tok(["1+2=", "33+44=", "5=", "1+2="] * 3, return_tensors="pt", padding=True, add_special_tokens=False)

    def draw():
        return sequences.sample_responses(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=24,
                                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                          generator=torch.Generator().manual_seed(3))

    swapped = []
    monkeypatch.setattr(sequences, "in_place_cache",
                        lambda past, new, dtype: swapped.append(new) or in_place_cache(past, new, dtype))
    ours = draw()
    monkeypatch.setattr(sequences, "in_place_cache", lambda past, new, dtype: past)
    theirs = draw()
    assert swapped == [24]
    assert 0 < int(ours[1].sum()) < ours[1].numel()  # some rows stopped early and left the batch
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
