"""The sampling loop against transformers' own generate and forward pass."""

import torch

from roll_core.strategies.sequences import response_log_probs, sample_responses, top_p_filter


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


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(top_p_filter(logits, 0.7))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    assert torch.isfinite(top_p_filter(logits, 0.1)).sum() == 1  # the top token always survives
