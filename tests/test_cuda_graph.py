"""The decoding loop that CUDA graphs replay (:mod:`roll_core.strategies.cuda_graph`), run eagerly on
the CPU (``capture=False``): its fixed cache, mask, positions and finished rows must decode what the
eager sampler decodes. The capture itself needs a GPU: ``tests/test_cuda.py``."""

import functools
import warnings

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from roll_core.config import load_and_check, load_config
from roll_core.errors import ConfigError
from roll_core.strategies import cuda_graph
from roll_core.strategies.sequences import response_log_probs, sample_responses

fixed_rows = functools.partial(cuda_graph.sample_responses, capture=False)


def _setup(tiny_model_path, scale: float = 0.0):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    if scale:  # larger random weights than the embedded init, so continuations differ by prompt
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for weight in (p for p in model.parameters() if p.dim() == 2):
                weight.normal_(0, scale, generator=g)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    enc = tok(["1+2=", "33+44=", "5="], return_tensors="pt", padding=True, add_special_tokens=False)
    return model, tok, enc["input_ids"], enc["attention_mask"]


def test_greedy_decoding_over_the_fixed_batch_matches_transformers_generate(tiny_model_path):
    model, tok, ids, mask = _setup(tiny_model_path, scale=0.3)
    ours, rmask, _ = fixed_rows(model, ids, mask, max_new_tokens=7, eos_token_id=-1, pad_token_id=tok.pad_token_id,
                                temperature=0)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=7, do_sample=False, eos_token_id=None,
                         pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    assert rmask.tolist() == [[1] * 7] * 3
    assert ours.tolist() == ref.tolist()
    assert len({tuple(row) for row in ours.tolist()}) == 3  # the prompts' own continuations, not one repeated


def test_finished_rows_stay_in_the_batch_but_keep_what_the_eager_sampler_gives_them(tiny_model_path):
    """Rows that end at different steps: each stops at its end id, is padded after it with log-prob 0,
    and has the tokens and log-probs the eager sampler (which drops finished rows) gives it."""
    model, tok, ids, mask = _setup(tiny_model_path, scale=0.3)
    ids, mask = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)
    alone = sample_responses(model, ids, mask, max_new_tokens=6, eos_token_id=-1, pad_token_id=tok.pad_token_id,
                             temperature=0)[0].tolist()

    def stops_at(end):
        return [row.index(end) + 1 if end in row else 6 for row in alone]

    end = max({t for row in alone for t in row}, key=lambda t: len(set(stops_at(t))))
    stops = stops_at(end)
    assert len(set(stops)) >= 2, (alone, stops)
    eager = sample_responses(model, ids, mask, max_new_tokens=6, eos_token_id=end, pad_token_id=tok.pad_token_id,
                             temperature=0)
    fixed = fixed_rows(model, ids, mask, max_new_tokens=6, eos_token_id=end, pad_token_id=tok.pad_token_id,
                       temperature=0)
    assert fixed[0].tolist() == eager[0].tolist()
    assert fixed[1].tolist() == eager[1].tolist() == [[1] * n + [0] * (max(stops) - n) for n in stops]
    torch.testing.assert_close(fixed[2], eager[2], atol=1e-5, rtol=0)
    assert (fixed[2] * (1 - fixed[1]) == 0).all()


def test_sampled_log_probs_are_those_of_a_fresh_forward_pass_before_the_top_p_cut(tiny_model_path):
    model, tok, ids, mask = _setup(tiny_model_path)
    resp, rmask, logp = fixed_rows(model, ids, mask, max_new_tokens=5, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id, temperature=0.7, top_p=0.9,
                                   generator=torch.Generator().manual_seed(1))  # outside no_grad, as a library user
    recomputed = response_log_probs(model, torch.cat([ids, resp], 1), torch.cat([mask, rmask], 1), resp.shape[1],
                                    temperature=0.7)
    torch.testing.assert_close(recomputed * rmask, logp, atol=1e-4, rtol=1e-4)


def test_the_loop_stops_when_asked_and_runs_no_forward_pass_whose_logits_go_unused(tiny_model_path):
    model, tok, ids, mask = _setup(tiny_model_path)
    passes = []
    hook = model.register_forward_hook(lambda module, args, kwargs, out: passes.append(kwargs["input_ids"].shape[1]),
                                       with_kwargs=True)
    resp, rmask, _ = fixed_rows(model, ids, mask, max_new_tokens=6, eos_token_id=-1, pad_token_id=tok.pad_token_id)
    assert passes == [ids.shape[1]] + [1] * 5 and rmask.shape == (3, 6)
    passes.clear()
    asked = iter([False, False, True])
    resp, rmask, _ = fixed_rows(model, ids, mask, max_new_tokens=6, eos_token_id=-1, pad_token_id=tok.pad_token_id,
                                should_stop=lambda: next(asked))
    hook.remove()
    assert passes == [ids.shape[1]] + [1] * 2 and rmask.tolist() == [[1] * 3] * 3


def test_a_fixed_layer_writes_the_position_it_is_pointed_at_and_attends_over_all():
    keys, values = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4)
    at = torch.tensor([3])
    layer = cuda_graph.FixedLayer(keys, values, total=6, at=at)
    new_k, new_v = torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4)
    k, v = layer.update(new_k, new_v, 0)
    assert k.shape == v.shape == (2, 1, 6, 4) and layer.get_seq_length() == 6
    torch.testing.assert_close(k[:, :, :3], keys) and torch.testing.assert_close(v[:, :, :3], values)
    torch.testing.assert_close(k[:, :, 3:4], new_k) and torch.testing.assert_close(v[:, :, 3:4], new_v)
    at.fill_(5)
    k, _ = layer.update(new_v, new_v, 0)
    torch.testing.assert_close(k[:, :, 5:6], new_v)
    assert (k[:, :, 4] == 0).all()  # never written: the mask keeps it out
    # under autocast a step's keys and values can come in another dtype than the prefill's: cast as written
    at.fill_(4)
    k, v = layer.update(new_k.bfloat16(), new_v.bfloat16(), 0)
    assert k.dtype == v.dtype == torch.float32
    torch.testing.assert_close(v[:, :, 4:5], new_v.bfloat16().float())


def test_a_cache_with_a_layer_of_another_kind_is_left_to_the_eager_sampler():
    cache = DynamicCache()
    cache.layers = [DynamicSlidingWindowLayer(sliding_window=4)]
    cache.layers[0].update(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4))
    assert cuda_graph.fixed_cache(cache, 5, torch.tensor([2])) is None
    assert cuda_graph.fixed_cache(object(), 5, torch.tensor([2])) is None


def test_graphs_are_tried_on_cuda_with_sdpa_attention_only(tiny_model_path):
    model, *_ = _setup(tiny_model_path)
    assert model.config._attn_implementation == "sdpa"
    assert cuda_graph.supported(model, torch.device("cuda")) and not cuda_graph.supported(model, torch.device("cpu"))
    model.config._attn_implementation = "eager"  # adds its mask: a boolean one would be added as 0 and 1
    assert not cuda_graph.supported(model, torch.device("cuda"))
    assert not cuda_graph.supported(torch.nn.Linear(2, 2), torch.device("cuda"))  # no config: not a transformers model
    assert cuda_graph.options(object()).cuda_graphs  # a role config without options takes the defaults


def _engine(tiny_model_path, monkeypatch, *overrides):
    """The hf inference strategy on the CPU, also where a GPU is present."""
    import roll_core.strategies.hf as hf

    monkeypatch.setattr(hf, "default_device", lambda: torch.device("cpu"))
    cfg = load_config(None, list(overrides))
    return hf.HFInferStrategy(str(tiny_model_path), cfg.roles.actor_infer, seed=0)


def _prompts():
    from roll_core.data import Batch

    return Batch({"prompt_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]),
                  "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])})


def test_the_hf_engine_decodes_over_the_fixed_batch_where_graphs_apply_and_as_before_elsewhere(tiny_model_path,
                                                                                               monkeypatch):
    calls = []
    original = cuda_graph.sample_responses
    monkeypatch.setattr(cuda_graph, "sample_responses", lambda *a, **k: calls.append(k) or original(*a, **k))
    engine = _engine(tiny_model_path, monkeypatch)
    assert engine.cuda_graphs  # on by default
    engine.generate(_prompts(), max_new_tokens=3, temperature=1.0, top_p=1.0)
    assert calls == []  # the CPU decodes eagerly
    monkeypatch.setattr(cuda_graph, "supported", lambda model, device: True)
    out = engine.generate(_prompts(), max_new_tokens=3, temperature=1.0, top_p=0.9, top_k=5)
    assert len(calls) == 1 and calls[0]["top_p"] == 0.9 and calls[0]["top_k"] == 5
    assert calls[0]["eos_token_id"] == engine.end_ids and calls[0]["generator"] is engine.generator
    assert out["responses"].shape == out["infer_log_probs"].shape == (2, 3)
    off = _engine(tiny_model_path, monkeypatch, "roles.actor_infer.strategy_options.cuda_graphs=false")
    off.generate(_prompts(), max_new_tokens=3, temperature=1.0, top_p=1.0)
    assert not off.cuda_graphs and len(calls) == 1


def test_a_step_that_cannot_be_captured_is_warned_about_once_and_decoded_eagerly_after(tiny_model_path, monkeypatch):
    tries = []

    def refuse(*args, **kwargs):
        tries.append(1)
        raise cuda_graph.CaptureFailed("the decoding step could not be captured as a CUDA graph: synchronised")

    monkeypatch.setattr(cuda_graph, "supported", lambda model, device: True)
    monkeypatch.setattr(cuda_graph, "sample_responses", refuse)
    engine = _engine(tiny_model_path, monkeypatch)
    with pytest.warns(RuntimeWarning, match="could not be captured.*decodes without CUDA graphs from now on"):
        out = engine.generate(_prompts(), max_new_tokens=3, temperature=1.0, top_p=1.0)
    assert out["responses"].shape == (2, 3) and not engine.cuda_graphs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.generate(_prompts(), max_new_tokens=3, temperature=1.0, top_p=1.0)
    assert len(tries) == 1


def test_cuda_graphs_is_an_option_of_the_inference_role_alone():
    assert load_and_check(None, []).roles.actor_infer.strategy_options["cuda_graphs"] is True
    cfg = load_and_check(None, ["roles.actor_infer.strategy_options.cuda_graphs=false"])
    assert cfg.roles.actor_infer.strategy_options == {"precision": "fp32", "cuda_graphs": False}
    with pytest.raises(ConfigError, match="'roles.actor_train.strategy_options' for train strategy 'hf': unknown "
                       "option 'cuda_graphs'. Valid options: precision"):
        load_and_check(None, ["roles.actor_train.strategy_options.cuda_graphs=false"])
    with pytest.raises(ConfigError, match="unknown option 'cuda_graph'. Did you mean 'cuda_graphs'?"):
        load_and_check(None, ["roles.actor_infer.strategy_options.cuda_graph=false"])


def test_a_subclass_with_options_of_its_own_says_whether_it_wants_graphs(tiny_model_path, monkeypatch):
    import roll_core.strategies.hf as hf
    from roll_core.config.schema import InferRoleConfig

    class OwnOptions(hf.HFInferStrategy):  # as a plugin that registers an options model of its own
        def autocast_precision(self, role_config) -> str:
            return "fp32"

        def graphs_wanted(self, role_config) -> bool:
            return role_config.strategy_options["engine_graphs"] == "on"

    monkeypatch.setattr(hf, "default_device", lambda: torch.device("cpu"))
    role = InferRoleConfig(strategy_options={"engine_graphs": "off"})
    assert not OwnOptions(str(tiny_model_path), role, seed=0).cuda_graphs
    with pytest.raises(ValueError, match="engine_graphs"):  # the hf strategy's own options refuse the key
        hf.HFInferStrategy(str(tiny_model_path), role, seed=0)
