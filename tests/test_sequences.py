"""The sampling loop against transformers' own generate and forward pass."""

import pytest
import torch

import roll_core.strategies.sequences as sequences
from roll_core.strategies.sequences import (block_sums, draw_tokens, next_tokens, nucleus_sampler, nucleus_tokens,
                                            prompt_groups, response_log_probs, sample_responses,
                                            sorted_nucleus_tokens, surviving_rows)

NUCLEUS_DRAWS = pytest.mark.parametrize("nucleus", [nucleus_tokens, sorted_nucleus_tokens], ids=["rejection", "sort"])


def _setup(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    enc = tok(["1+2=", "33+44=", "5="], return_tensors="pt", padding=True, add_special_tokens=False)
    return model, tok, enc["input_ids"], enc["attention_mask"]


def test_greedy_matches_transformers_generate_with_left_padding(tiny_model_path):
    model, tok, ids, mask = _setup(tiny_model_path)
    ours, rmask, _ = sample_responses(model, ids, mask, max_new_tokens=6, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id, temperature=0)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    for row in range(len(ids)):
        n = int(rmask[row].sum())
        assert ours[row, :n].tolist() == ref[row, :n].tolist()


def test_sampler_log_probs_match_a_fresh_forward_pass(tiny_model_path):
    model, tok, ids, mask = _setup(tiny_model_path)
    gen = torch.Generator().manual_seed(1)
    resp, rmask, logp = sample_responses(model, ids, mask, max_new_tokens=5, eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id, temperature=0.7, generator=gen)
    full = torch.cat([ids, resp], 1)
    recomputed = response_log_probs(model, full, torch.cat([mask, rmask], 1), resp.shape[1], temperature=0.7)
    torch.testing.assert_close(recomputed * rmask, logp, atol=1e-4, rtol=1e-4)
    # the full distribution (for distribution KL estimators) holds the same token log-probs
    _, _, dist = response_log_probs(model, full, torch.cat([mask, rmask], 1), resp.shape[1], temperature=0.7,
                                    with_distribution=True)
    torch.testing.assert_close(dist.gather(-1, resp[..., None]).squeeze(-1), recomputed)


def test_same_generator_seed_same_samples(tiny_model_path):
    model, tok, ids, mask = _setup(tiny_model_path)
    draws = [
        sample_responses(model, ids, mask, max_new_tokens=5, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(9))[0]
        for _ in range(2)
    ]
    assert torch.equal(draws[0], draws[1])


def _shares(tokens: torch.Tensor, vocab: int) -> list[float]:
    return (torch.bincount(tokens, minlength=vocab) / len(tokens)).tolist()


@pytest.mark.parametrize("top_p, shares", [
    (0.7, [0.625, 0.375, 0, 0]),  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the first two, renormalised
    (0.81, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),  # 0.8 < 0.81: the third joins
    (0.5, [1, 0, 0, 0]),  # the heaviest alone reaches 0.5
    (0.1, [1, 0, 0, 0]),  # the heaviest always belongs
    (1.0, [0.5, 0.3, 0.15, 0.05]),
])
@NUCLEUS_DRAWS
def test_nucleus_tokens_draw_the_smallest_nucleus_in_proportion_to_weight(top_p, shares, nucleus):
    weights = torch.tensor([[0.05, 0.15, 0.3, 0.5]]).flip(-1).repeat(20_000, 1) * 4  # not normalised
    tokens = nucleus(weights, weights.sum(-1, keepdim=True), top_p, torch.Generator().manual_seed(0))
    assert _shares(tokens, 4) == pytest.approx(shares, abs=0.012)
    assert torch.equal(weights, torch.tensor([[2.0, 1.2, 0.6, 0.2]]).repeat(20_000, 1))  # left as they were


@pytest.fixture
def rows_drawn(monkeypatch) -> list[int]:
    """The number of rows of every ``draw_tokens`` call the sampler makes, in order."""
    rows: list[int] = []

    def counted(weights, generator=None, sums=None):
        rows.append(len(weights))
        return draw_tokens(weights, generator, sums)

    monkeypatch.setattr(sequences, "draw_tokens", counted)
    return rows


@pytest.mark.parametrize("chunk", [16_384, 7, 3])
def test_nucleus_tokens_reject_draws_from_a_heavy_tail_until_they_land_inside(chunk, monkeypatch, rows_drawn):
    """Half the weight on token 3, the other half spread evenly over 999 light tokens: the nucleus of
    0.5 is token 3 alone, so half the first draws land in the tail and those rows draw again; a
    nucleus of 0.6 holds every token (each light one has 0.5 heavier than it), so nothing is drawn
    twice. The caller's weights stay as they were."""
    monkeypatch.setattr(sequences, "NUCLEUS_CHUNK", chunk)  # 3 and 7: the passes go chunk by chunk
    row = torch.full((1000,), 0.5 / 999)
    row[3] = 0.5
    weights = row.repeat(4000, 1)
    tokens = nucleus_tokens(weights, weights.sum(-1, keepdim=True), 0.5, torch.Generator().manual_seed(0))
    assert (tokens == 3).all() and torch.equal(weights, row.repeat(4000, 1))
    # a rejected row rules out every token as light as its draw: here the whole tail at once
    assert len(rows_drawn) == 2 and rows_drawn[0] == 4000 and 1800 < rows_drawn[1] < 2200, rows_drawn
    rows_drawn.clear()
    tokens = nucleus_tokens(weights, weights.sum(-1, keepdim=True), 0.6, torch.Generator().manual_seed(0))
    assert 0.47 < (tokens == 3).float().mean() < 0.53 and rows_drawn == [4000]


@NUCLEUS_DRAWS
@pytest.mark.parametrize("top_p", [0.5, 1.0])
def test_next_tokens_draw_from_the_generator_alone_also_when_they_draw_again(top_p, nucleus, monkeypatch):
    """The same generator seed gives the same tokens whatever the global RNG did. Token 3 weighs 0.45
    and 999 others about 0.00055 each, so a nucleus of 0.5 holds token 3 and the heaviest 91 others:
    by rejection, about half the rows draw a token outside it and draw again, from the same generator."""
    monkeypatch.setattr(sequences, "nucleus_sampler", lambda device: nucleus)
    row = torch.full((1000,), 0.55 / 999).log()
    row[3] = torch.tensor(0.45).log()
    logits = row.repeat(2000, 1) + torch.rand(2000, 1000, generator=torch.Generator().manual_seed(0)) * 1e-3
    draws = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        draws.append(next_tokens(logits.clone(), 1.0, top_p, torch.Generator().manual_seed(7))[0])
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], next_tokens(logits.clone(), 1.0, top_p, torch.Generator().manual_seed(8))[0])


@NUCLEUS_DRAWS
def test_nucleus_tokens_match_the_sorted_nucleus_of_each_row_over_several_rounds(nucleus, rows_drawn):
    """Three kinds of row, interleaved, with distinct weights: a rejected draw rules out only the tokens
    lighter than it, so rows take several rounds, each on the rows still drawing. Every row's tokens
    must come from its own nucleus (as sorting defines it) in proportion to weight; the sort's own
    draw is one round over every row."""
    steep = torch.exp(-torch.arange(300.0) / 20)
    kinds = torch.stack([steep, steep.flip(0), 1 + torch.rand(300, generator=torch.Generator().manual_seed(3))])
    weights = kinds.repeat(6000, 1)
    tokens = nucleus(weights, weights.sum(-1, keepdim=True), 0.6, torch.Generator().manual_seed(0)).view(6000, 3)
    assert rows_drawn[0] == 18_000 and (len(rows_drawn) >= 3 if nucleus is nucleus_tokens else len(rows_drawn) == 1)
    for kind in range(3):
        ordered, order = kinds[kind].sort(descending=True)
        before = ordered.cumsum(0) - ordered
        nucleus = torch.zeros(300).index_put_((order,), (before < 0.6 * ordered.sum()).float())
        expected = kinds[kind] * nucleus / (kinds[kind] * nucleus).sum()
        shares = torch.bincount(tokens[:, kind], minlength=300) / 6000
        assert shares[nucleus == 0].sum() == 0
        assert 0.5 * (shares - expected).abs().sum() < 0.05 * (1 + (nucleus.sum() > 50))  # sampling noise


@NUCLEUS_DRAWS
def test_nucleus_tokens_keep_tokens_as_heavy_as_the_heaviest_and_refuse_a_top_p_of_zero(nucleus):
    weights = torch.tensor([[0.4, 0.2, 0.4]]).repeat(20_000, 1)  # a tie at the top: both belong to a nucleus of 0.3
    tokens = nucleus(weights, weights.sum(-1, keepdim=True), 0.3, torch.Generator().manual_seed(0))
    assert _shares(tokens, 3) == pytest.approx([0.5, 0, 0.5], abs=0.012)
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 0.0$"):
        nucleus(weights, weights.sum(-1, keepdim=True), 0.0)


def test_next_tokens_draw_the_nucleus_by_rejection_on_the_cpu_and_by_sort_on_a_gpu(monkeypatch):
    """A sort of the vocabulary is slow on the CPU and fast on a GPU, where each rejection round waits
    for the device (``benchmarks/bench_next_token.py``). next_tokens asks for the draw by its logits' device."""
    assert nucleus_sampler(torch.device("cpu")) is nucleus_tokens
    assert nucleus_sampler(torch.device("cuda", 0)) is sorted_nucleus_tokens
    asked = []
    monkeypatch.setattr(sequences, "nucleus_sampler", lambda device: asked.append(device) or nucleus_tokens)
    next_tokens(torch.zeros(2, 5), 1.0, 0.5)
    next_tokens(torch.zeros(2, 5), 1.0, 1.0)  # no nucleus to draw
    assert asked == [torch.device("cpu")]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0, 1e-3])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_next_tokens_log_probs_are_log_softmax_at_the_temperature_before_top_p(temperature, top_p):
    logits = torch.randn(64, 50_000, generator=torch.Generator().manual_seed(0)) * 4
    expected = (logits / temperature).log_softmax(-1)
    token, logp = next_tokens(logits.clone(), temperature, top_p, torch.Generator().manual_seed(1))
    torch.testing.assert_close(logp, expected.gather(-1, token[:, None]).squeeze(-1), atol=2e-5, rtol=1e-5)
    greedy, greedy_logp = next_tokens(logits.clone(), 0.0)
    assert torch.equal(greedy, logits.argmax(-1))
    torch.testing.assert_close(greedy_logp, logits.log_softmax(-1).amax(-1), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.5, 1.0), (2.0, 0.9)])
def test_next_tokens_draw_from_softmax_at_the_temperature(temperature, top_p):
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0, 0.5]])
    probs = (logits / temperature).softmax(-1)[0]
    if top_p < 1:  # at 2.0 the heaviest four weigh 0.92 >= 0.9 (0.83 before the fourth): the fifth is out
        assert probs.sort(descending=True).values[:3].sum() < top_p <= probs.sort(descending=True).values[:4].sum()
        probs[3] = 0
        probs /= probs.sum()
    token, _ = next_tokens(logits.repeat(40_000, 1), temperature, top_p, torch.Generator().manual_seed(0))
    assert _shares(token, 5) == pytest.approx(probs.tolist(), abs=0.01)


@pytest.mark.parametrize("block", [256, 4, 3], ids=["one-block", "blocks-of-4", "blocks-of-3"])
def test_draw_tokens_draws_each_token_as_often_as_its_weight_and_never_one_of_weight_zero(block, monkeypatch):
    monkeypatch.setattr(sequences, "DRAW_BLOCK", block)  # 4: a block of zeros and a short last one
    weights = torch.tensor([0.1, 0.0, 0.2, 0.7, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5])  # not normalised: the total is 2
    tokens = draw_tokens(weights.repeat(20_000, 1), torch.Generator().manual_seed(0))
    shares = torch.bincount(tokens, minlength=10) / 20_000
    assert shares.tolist() == pytest.approx([0.05, 0, 0.1, 0.35, 0, 0, 0, 0, 0.25, 0.25], abs=0.012)
    assert shares[weights == 0].sum() == 0
    again = draw_tokens(weights.repeat(20_000, 1), torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)  # the generator decides


def test_block_sums_sum_each_block_of_columns_and_a_short_last_one(monkeypatch):
    monkeypatch.setattr(sequences, "DRAW_BLOCK", 4)
    weights = torch.arange(10.0).repeat(2, 1) * torch.tensor([[1.0], [2.0]])
    assert block_sums(weights).tolist() == [[6, 22, 17], [12, 44, 34]]  # 0+1+2+3, 4+..+7, 8+9
    assert block_sums(weights[:, :8]).tolist() == [[6, 22], [12, 44]]  # no short block
    assert block_sums(weights[:, :3]).tolist() == [[3], [6]]  # one block: the row's sum


def test_draw_tokens_search_the_block_sums_they_are_given(monkeypatch):
    """Sums that put every row's target in block 1 make every draw come from that block, by its weights."""
    monkeypatch.setattr(sequences, "DRAW_BLOCK", 4)
    weights = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 3.0, 1.0, 0.0, 5.0]]).repeat(20_000, 1)
    tokens = draw_tokens(weights, torch.Generator().manual_seed(0), torch.tensor([[0.0, 4.0, 0.0]]).repeat(20_000, 1))
    assert _shares(tokens, 9) == pytest.approx([0, 0, 0, 0, 0, 0.75, 0.25, 0, 0], abs=0.012)


@pytest.mark.parametrize("top_k, top_p, passes", [(0, 1.0, 1), (2, 1.0, 2), (0, 0.9, 1), (2, 0.9, 2)])
def test_next_tokens_sum_the_vocabulary_once_and_again_only_after_a_top_k_cut(top_k, top_p, passes, monkeypatch):
    """The totals (the log-probabilities' normaliser) and the draw's first search come from one pass
    of block sums; a top-k cut changes the weights, so it takes one more. (The nucleus' own draw
    sums its rows itself.)"""
    calls = []
    monkeypatch.setattr(sequences, "block_sums", lambda w: calls.append(w.shape) or block_sums(w))
    monkeypatch.setattr(sequences, "nucleus_sampler", lambda device: lambda w, kept, p, g: w.argmax(-1))
    next_tokens(torch.randn(3, 1000), 0.7, top_p, None, top_k)
    assert len(calls) == passes


@pytest.mark.parametrize("temperature", [1.0, 0.7, 3.0])
def test_token_weights_are_softmax_at_the_temperature_scaled_to_one_at_the_argmax(temperature):
    logits = torch.randn(8, 5000, generator=torch.Generator().manual_seed(0)) * 5
    weights = sequences.token_weights_(logits.clone(), temperature)
    assert torch.equal(weights.amax(-1), torch.ones(8)) and torch.equal(weights.argmax(-1), logits.argmax(-1))
    torch.testing.assert_close(weights / weights.sum(-1, keepdim=True), (logits / temperature).softmax(-1),
                               atol=1e-9, rtol=2e-6)


def test_draw_tokens_finds_the_last_entry_of_a_large_vocabulary():
    weights = torch.zeros(3, 151_936)  # Qwen2.5's vocabulary: 593 blocks of 256 and a short one of 128
    weights[0, -1], weights[1, 0], weights[2, 70_000] = 1e-30, 3.0, 1.0
    weights[2, 150_000] = 1.0
    tokens = draw_tokens(weights.repeat(200, 1), torch.Generator().manual_seed(1)).view(200, 3)
    assert (tokens[:, 0] == 151_935).all() and (tokens[:, 1] == 0).all()
    assert set(tokens[:, 2].tolist()) == {70_000, 150_000}


def test_a_target_past_what_a_block_holds_by_its_own_sums_takes_its_last_token_of_weight(monkeypatch):
    """A block's float32 sum (1e8 + 5 rounds to 1e8 + 8) passes its float64 cumulative weights
    (1e8 + 5): a target between the two belongs to the block's last token of weight. Not the next
    block's first, which weighs 0 in the first row; not a position past the vocabulary, in the second
    row's short last block. The third row's block ends on a token of weight: each row has its own."""
    monkeypatch.setattr(sequences, "DRAW_BLOCK", 4)  # a vocabulary of 10: blocks of 4, 4 and 2
    weights = torch.tensor([[1e8, 5.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
                            [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1e8, 5.0],
                            [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    block = float(torch.tensor([1e8, 5.0]).sum())  # 1e8 + 8, as draw_tokens sums a block
    targets = [1e8 + 6, 1 + 1e8 + 6, 3.5]
    u = torch.tensor([[targets[0] / (block + 1)], [targets[1] / (1 + block)], [targets[2] / 4]], dtype=torch.float64)
    monkeypatch.setattr(torch, "rand", lambda *shape, **kwargs: u.clone())
    assert draw_tokens(weights).tolist() == [1, 9, 3]


@pytest.mark.parametrize("block", [256, 2])
@pytest.mark.parametrize("u, token", [(0.0, 3), (1.0, 5)], ids=["u=0", "u rounded up to 1"])
def test_the_uniform_s_extremes_draw_the_first_and_last_tokens_of_weight(block, u, token, monkeypatch):
    """A target exactly at a cumulative weight (0 here, before any weight) goes to the block and the
    token that pass it; ``u`` is below 1, but one that rounds up to it still draws a token of weight."""
    monkeypatch.setattr(sequences, "DRAW_BLOCK", block)  # 2: the first block weighs 0, the second starts with a 0
    monkeypatch.setattr(torch, "rand", lambda *shape, **kwargs: torch.full(shape[0], u, dtype=torch.float64))
    assert draw_tokens(torch.tensor([[0.0, 0.0, 0.0, 0.3, 0.0, 0.7]])).tolist() == [token]


@pytest.mark.parametrize("row", [[0.0, 0.0], [float("nan"), 1.0], [float("inf"), 1.0]])
def test_draw_tokens_refuses_weights_without_a_finite_positive_total(row):
    with pytest.raises(ValueError, match="^every row's weights must be finite, non-negative and not all zero$"):
        draw_tokens(torch.tensor([[0.5, 0.5], row]))


@pytest.mark.parametrize("going, rows", [
    ([1, 0, 1, 0, 1, 1], [0, 4, 2, 5]),  # the finished rows' places filled from the end, in order
    ([1, 1, 1], [0, 1, 2]),
    ([0, 0, 1, 1], [2, 3]),
    ([1, 1, 0, 0], [0, 1]),  # the finished rows are the last ones: nothing moves
    ([0, 1, 0], [1]),
])
def test_surviving_rows_keep_their_places_and_fill_the_finished_ones_from_the_end(going, rows):
    assert surviving_rows(torch.tensor(going, dtype=torch.bool)).tolist() == rows


def test_prompt_groups_number_prompts_as_they_first_come_and_ignore_padding():
    # samples 0, 2 and 4 are one prompt (4 under other padding), 1 and 3 another; 5 has 3's tokens
    # under its mask but over other images
    ids = torch.tensor([[0, 7, 8], [5, 6, 2], [0, 7, 8], [5, 6, 2], [9, 7, 8], [5, 6, 2]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    first, group = prompt_groups(ids, mask)
    assert first.tolist() == [0, 1] and group.tolist() == [0, 1, 0, 1, 0, 1]
    images = torch.zeros(6, 1, 3, 2, 2)
    images[5] = 1.0
    first, group = prompt_groups(ids, mask, images)
    assert first.tolist() == [0, 1, 5] and group.tolist() == [0, 1, 0, 1, 0, 2]
    # numbered as they first come, not in sorted order (where the left-padded prompt comes first)
    first, group = prompt_groups(ids.flip(0), mask.flip(0))
    assert first.tolist() == [0, 1] and group.tolist() == [0, 1, 0, 1, 0, 1]
    ids[3, 0] = 4  # one token differs under the mask: a prompt of its own
    assert prompt_groups(ids, mask)[1].tolist() == [0, 1, 0, 2, 0, 1]


def test_repeated_prompts_and_early_stops_decode_as_each_row_would_alone(tiny_model_path):
    """A group's prompt is prefilled once and finished rows leave the batch: every row still gets
    the tokens it gets decoded by itself, stops at its first EOS and has its own log-probs."""
    model, tok, ids, mask = _setup(tiny_model_path)
    with torch.no_grad():  # larger random weights than the embedded init, so greedy continuations differ by prompt
        g = torch.Generator().manual_seed(0)
        for weight in (p for p in model.parameters() if p.dim() == 2):
            weight.normal_(0, 0.3, generator=g)
    ids, mask = ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)  # three groups of three
    alone = [sample_responses(model, ids[i:i + 1], mask[i:i + 1], max_new_tokens=6, eos_token_id=-1,
                              pad_token_id=tok.pad_token_id, temperature=0)[0][0].tolist() for i in range(0, 9, 3)]

    def stops_at(eos):
        return [row.index(eos) + 1 if eos in row else 6 for row in alone]

    # an "EOS" that the groups reach at the most different steps, so rows leave the batch early
    eos = max(set(alone[0]), key=lambda token: len(set(stops_at(token))))
    stops = stops_at(eos)
    assert len(set(stops)) == 3, (alone, stops)
    resp, rmask, logp = sample_responses(model, ids, mask, max_new_tokens=6, eos_token_id=eos,
                                         pad_token_id=tok.pad_token_id, temperature=0)
    assert resp.shape[1] == max(stops)
    for row in range(9):
        n = stops[row // 3]
        assert rmask[row].tolist() == [1] * n + [0] * (resp.shape[1] - n)
        assert resp[row, :n].tolist() == alone[row // 3][:n]
        assert (resp[row, n:] == tok.pad_token_id).all() and (logp[row, n:] == 0).all()
    recomputed = response_log_probs(model, torch.cat([ids, resp], 1), torch.cat([mask, rmask], 1), resp.shape[1])
    torch.testing.assert_close(recomputed * rmask, logp, atol=1e-4, rtol=1e-4)


def test_sampling_a_repeated_prompt_draws_from_its_own_distribution_per_sample(tiny_model_path):
    model, tok, ids, mask = _setup(tiny_model_path)
    ids, mask = ids[:1].repeat(64, 1), mask[:1].repeat(64, 1)
    resp, rmask, logp = sample_responses(model, ids, mask, max_new_tokens=4, eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(3))
    assert len({tuple(r.tolist()) for r in resp}) > 8  # the copies of the prompt's cache are sampled apart
    recomputed = response_log_probs(model, torch.cat([ids, resp], 1), torch.cat([mask, rmask], 1), resp.shape[1])
    torch.testing.assert_close(recomputed * rmask, logp, atol=1e-4, rtol=1e-4)


def test_the_kv_cache_goes_by_the_name_the_installed_transformers_takes(tiny_model_path):
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns, and goes in
    5.40): the sampler passes whichever the model's forward declares, and never the other."""
    import functools
    import inspect

    from roll_core.strategies.sequences import cache_keyword

    model, tok, ids, mask = _setup(tiny_model_path)
    declared = inspect.signature(model.forward).parameters
    expected = "cache" if "cache" in declared else "past_key_values"
    assert cache_keyword(model) == expected
    passed: list[set[str]] = []
    forward = model.forward

    @functools.wraps(forward)  # keeps the signature the sampler reads
    def recording(*args, **kwargs):
        passed.append(set(kwargs))
        return forward(*args, **kwargs)

    model.forward = recording
    sample_responses(model, ids, mask, max_new_tokens=4, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, temperature=0)
    decoding = passed[1:]  # after the prefill, every step passes the cache
    assert decoding and all(expected in keys for keys in decoding)
    assert not any({"cache", "past_key_values"} - {expected} & keys for keys in passed)

    class OldModel(torch.nn.Module):  # transformers before 5.24
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return None

    assert cache_keyword(OldModel()) == "past_key_values"


def test_the_sampler_runs_no_forward_pass_whose_logits_go_unused(tiny_model_path):
    model, tok, ids, mask = _setup(tiny_model_path)
    passes = []
    hook = model.register_forward_hook(lambda module, args, kwargs, out: passes.append(kwargs["input_ids"].shape[1]),
                                       with_kwargs=True)
    responses, rmask, _ = sample_responses(model, ids, mask, max_new_tokens=6, eos_token_id=-1,  # never sampled
                                           pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(0))
    hook.remove()
    assert int(rmask.sum()) == rmask.numel() == 3 * 6  # every row ran to the limit
    assert passes == [ids.shape[1]] + [1] * 5  # the prefill gives the first token, 5 decoding steps the rest


@pytest.mark.parametrize("top_k, top_p, shares", [
    (2, 1.0, [0.5 / 0.8, 0.3 / 0.8, 0, 0]),  # the two heaviest, renormalised
    (3, 0.7, [0.5 / 0.8, 0.3 / 0.8, 0, 0]),  # the top 3 weigh 0.95; its nucleus of 0.7 of that is the first two
    (2, 0.6, [1, 0, 0, 0]),  # 0.6 of the two's 0.8 is 0.48, which the heaviest alone reaches (not 0.6 of 1)
    (1, 1.0, [1, 0, 0, 0]),  # top-k 1 is greedy
    (4, 1.0, [0.5, 0.3, 0.15, 0.05]),  # the whole vocabulary: no cut
])
def test_next_tokens_cut_to_the_top_k_then_to_the_nucleus_of_what_is_left(top_k, top_p, shares):
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    token, logp = next_tokens(logits.repeat(40_000, 1), 1.0, top_p, torch.Generator().manual_seed(0), top_k)
    assert _shares(token, 4) == pytest.approx(shares, abs=0.01)
    # each drawn token's log-prob is that of the whole distribution, before the cuts
    torch.testing.assert_close(logp, logits[0].log_softmax(-1)[token])


def test_top_k_weights_zero_each_row_below_its_own_kth_heaviest_in_place():
    weights = torch.tensor([[0.4, 0.35, 0.25, 0.0], [0.9, 0.05, 0.03, 0.02]])  # row 2's 2nd is below row 1's 3rd
    kept = sequences.top_k_weights_(weights, 2)
    torch.testing.assert_close(weights, torch.tensor([[0.4, 0.35, 0, 0], [0.9, 0.05, 0, 0]]), atol=0, rtol=0)
    torch.testing.assert_close(kept, torch.tensor([[0.75], [0.95]]))
    # fewer rows than top_k: the cut is against the vocabulary's width alone
    draws = [next_tokens(torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log(), 1.0, 1.0, torch.Generator().manual_seed(s),
                         top_k=1)[0] for s in range(30)]
    assert torch.cat(draws).tolist() == [3] * 30


def test_a_top_k_tie_keeps_every_tied_token_and_a_negative_top_k_is_refused():
    logits = torch.tensor([[0.4, 0.2, 0.4]]).log().repeat(20_000, 1)  # a tie for the top: both stay at top_k=1
    token, _ = next_tokens(logits.clone(), 1.0, 1.0, torch.Generator().manual_seed(0), top_k=1)
    assert _shares(token, 3) == pytest.approx([0.5, 0, 0.5], abs=0.012)
    for temperature in (1.0, 0.0):
        with pytest.raises(ValueError, match=r"^top_k must be 0 \(all tokens\) or more, got -1$"):
            next_tokens(logits.clone(), temperature, top_k=-1)


def test_the_hf_engine_cuts_the_draw_and_keeps_the_log_probs_before_the_cuts(tiny_model_path):
    from roll_core.config import load_config
    from roll_core.strategies.hf import HFInferStrategy, HFTrainStrategy
    from roll_core.testing import assert_engine_cuts_before_log_probs

    cfg = load_config(None)
    engine = HFInferStrategy(str(tiny_model_path), cfg.roles.actor_infer, seed=0)
    assert_engine_cuts_before_log_probs(engine, HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0),
                                        atol=1e-4)


def test_the_ids_that_end_and_pad_a_response_come_from_both_configs():
    from types import SimpleNamespace as Config

    from roll_core.strategies.sequences import end_token_ids, padding_id, token_ids

    assert token_ids(7, None, [9, 7], (3,)) == [7, 9, 3]
    llama = Config(eos_token_id=[128001, 128008, 128009], pad_token_id=None)  # Llama 3.1 Instruct's config
    assert end_token_ids(llama, Config(eos_token_id=[128001, 128008, 128009])) == [128001, 128008, 128009]
    assert padding_id(llama) == 128001  # no padding id: the first end id
    qwen = Config(eos_token_id=151645, pad_token_id=None)  # Qwen2.5 Instruct: a second end id in its generation config
    assert end_token_ids(qwen, Config(eos_token_id=[151645, 151643], pad_token_id=151643)) == [151645, 151643]
    assert padding_id(qwen, Config(eos_token_id=[151645, 151643], pad_token_id=151643)) == 151643
    assert padding_id(Config(eos_token_id=2, pad_token_id=0)) == 0
    assert padding_id(Config(), Config(eos_token_id=[5, 6])) == 5  # the generation config's end ids alone
    assert end_token_ids(Config()) == [] and padding_id(Config()) == 0


def test_a_model_directory_names_its_end_ids_in_either_file(tiny_model_path, tmp_path):
    import json
    import shutil

    from roll_core.strategies.sequences import model_end_token_ids

    shutil.copytree(tiny_model_path, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, 11]}))
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert model_end_token_ids(tmp_path / "m") == [2, 11, 9]
    (tmp_path / "m" / "generation_config.json").unlink()  # none: the config's alone
    assert model_end_token_ids(tmp_path / "m") == [2, 11]
    # a multimodal model's config keeps its language model's ids in text_config; an architecture
    # transformers does not know (a model with its own code) is read all the same
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "own_arch", "text_config": {"eos_token_id": 5}}))
    assert model_end_token_ids(tmp_path / "m") == [5]


def test_a_response_ends_at_the_tokenizers_eos_and_every_id_the_model_files_name(tiny_model_path, tmp_path):
    from types import SimpleNamespace as Tokenizer

    from roll_core.strategies.sequences import response_end_ids, tokenizer_end_id
    from roll_core.testing import model_with_more_end_ids

    assert tokenizer_end_id(tiny_model_path) == 2 and response_end_ids(tiny_model_path) == [2]
    copy = model_with_more_end_ids(tiny_model_path, tmp_path / "m", tokenizer_eos=40, config_eos=41)
    assert tokenizer_end_id(copy) == 40
    assert response_end_ids(copy) == [40, 2, 41]  # the tokenizer's EOS first, then config.json's
    assert response_end_ids(copy, Tokenizer(eos_token_id=7)) == [7, 2, 41]  # a tokenizer given is the one read
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (copy / name).unlink(missing_ok=True)
    assert tokenizer_end_id(copy) is None and response_end_ids(copy) == [2, 41]  # saved without a tokenizer
    assert response_end_ids("org/a-hub-name") == []  # nothing read from a hub: the engines' configs name them


@pytest.mark.parametrize("files", [("tokenizer.json",), ("tokenizer_config.json",), ()])
def test_a_tokenizer_is_loaded_where_either_of_its_files_is_saved(tmp_path, monkeypatch, files):
    from types import SimpleNamespace as Tokenizer

    import transformers

    from roll_core.strategies.sequences import tokenizer_end_id

    loaded = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path: loaded.append(path) or Tokenizer(eos_token_id=99))
    for name in files:
        (tmp_path / name).write_text("{}")
    assert tokenizer_end_id(tmp_path) == (99 if files else None)
    assert loaded == ([str(tmp_path)] if files else [])


def test_the_hf_engine_stops_at_the_tokenizers_eos_and_every_config_end_id(tiny_model_path, tmp_path):
    from roll_core.config.schema import InferRoleConfig
    from roll_core.strategies.hf import HFInferStrategy
    from roll_core.testing import assert_engine_stops_at_every_end_id

    def engine(path):
        return HFInferStrategy(str(path), InferRoleConfig(), seed=0)

    assert_engine_stops_at_every_end_id(engine(tiny_model_path), engine, tiny_model_path, tmp_path / "m")


def model_without_padding_ending_at(tiny_model_path, directory, also_ends: list[int]):
    """The tiny model saved again with no padding id and, as Qwen2.5 Instruct's files do, ``also_ends``
    among the end ids of its generation config."""
    import json
    import shutil

    shutil.copytree(tiny_model_path, directory)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((directory / name).read_text())
        config.pop("pad_token_id")
        if name == "generation_config.json":
            config["eos_token_id"] = [config["eos_token_id"], *also_ends]
        (directory / name).write_text(json.dumps(config))
    return directory


def test_the_hf_engine_stops_at_every_end_id_and_pads_without_a_padding_id(tiny_model_path, tmp_path):
    from roll_core.config.schema import InferRoleConfig
    from roll_core.strategies.hf import HFInferStrategy
    from roll_core.testing import left_padded_prompts

    greedy = dict(max_new_tokens=5, temperature=0.0, top_p=1.0)
    plain = HFInferStrategy(str(tiny_model_path), InferRoleConfig(), seed=0).generate(left_padded_prompts(), **greedy)
    first = plain["responses"][0, 0].item()  # the first token row 0 decodes greedily
    assert plain["response_mask"][0].sum() > 1 and first != 2  # it went on past it, and is not EOS
    path = model_without_padding_ending_at(tiny_model_path, tmp_path / "model", [first])
    out = HFInferStrategy(str(path), InferRoleConfig(), seed=0).generate(left_padded_prompts(), **greedy)
    lengths = out["response_mask"].sum(-1)
    assert out["responses"][0].tolist()[:1] == [first] and lengths[0] == 1  # it ends at the model's second end id
    ends = torch.tensor([2, first])
    for row, n in zip(out["responses"], lengths.tolist()):  # every row stops at its first end id, padded after it
        assert not torch.isin(row[: n - 1], ends).any() and (n == 5 or row[n - 1] in ends)
        assert (row[n:] == 2).all()  # padded with the first end id


def test_a_response_that_fills_max_new_tokens_is_truncated_unless_it_ends_at_an_end_id(tiny_model_path, tmp_path):
    from roll_core.config import load_config
    from roll_core.data import Batch
    from roll_core.pipelines.runtime import load_tokenizer
    from roll_core.rollout.sync import SyncRolloutScheduler
    from roll_core.runtime.executor import LocalExecutor

    path = model_without_padding_ending_at(tiny_model_path, tmp_path / "model", [9])
    scheduler = SyncRolloutScheduler(load_config(None, ["rollout.max_new_tokens=3"]), LocalExecutor(), None, None,
                                     load_tokenizer(str(path)))
    rows = Batch({"responses": torch.tensor([[5, 6, 9], [5, 6, 7], [5, 2, 0], [5, 6, 2]]),
                  "response_mask": torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]])},
                 {"prompt": ["p"] * 4, "ground_truth": ["g"] * 4, "domain": ["default"] * 4})
    part, samples = scheduler._finish_request(rows)
    assert scheduler.end_ids.tolist() == [2, 9]  # the tokenizer's EOS, and the generation config's other end id
    assert part["truncated"].tolist() == [False, True, False, False] and len(samples) == 4
