import json
from collections import Counter

import pytest
import torch

from conftest import write_jsonl

from roll_core.data import Batch, DomainMixer, PromptStream, deal_slots, dp_shards, read_jsonl
from roll_core.errors import ConfigError


def make_batch(n=5):
    return Batch({"x": torch.arange(n * 2).view(n, 2)}, {"name": [f"r{i}" for i in range(n)]})


def test_chunk_then_concat_roundtrip():
    b = make_batch(5)
    parts = b.chunk(2)
    assert [len(p) for p in parts] == [3, 2]
    back = Batch.concat(parts)
    assert torch.equal(back["x"], b["x"]) and back["name"] == b["name"]


def test_concat_pads_ragged_widths():
    a = Batch({"r": torch.ones(1, 2)})
    b = Batch({"r": torch.ones(1, 3)})
    assert Batch.concat([a, b])["r"].tolist() == [[1, 1, 0], [1, 1, 1]]


def test_prompts_encoded_apart_join_left_padded_and_deeper_tensors_pad_at_each_end():
    # two groups of other prompt widths (the async scheduler's, dynamic sampling's rounds): each
    # prompt still ends where its response starts, which packing and the prefill rely on
    a = Batch({"prompt_ids": torch.tensor([[7, 8]]), "prompt_mask": torch.tensor([[1, 1]]),
               "responses": torch.tensor([[5, 6, 2]]), "images": torch.ones(1, 1, 2)})
    b = Batch({"prompt_ids": torch.tensor([[0, 3, 4, 9]]), "prompt_mask": torch.tensor([[0, 1, 1, 1]]),
               "responses": torch.tensor([[2]]), "images": torch.ones(1, 2, 1)})
    out = Batch.concat([a, b])
    assert out["prompt_ids"].tolist() == [[0, 0, 7, 8], [0, 3, 4, 9]]
    assert out["prompt_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert out["responses"].tolist() == [[5, 6, 2], [2, 0, 0]]
    assert out["images"].tolist() == [[[1, 1], [0, 0]], [[1, 0], [1, 0]]]


def test_split_and_select():
    b = make_batch(5)
    assert [len(p) for p in b.split(2)] == [2, 2, 1]
    sel = b.select(torch.tensor([True, False, True, False, False]))
    assert sel["name"] == ["r0", "r2"]


def test_prompt_stream_resumes_exactly():
    rows = [{"i": i} for i in range(7)]
    a = PromptStream(rows, seed=3)
    a.next(5)
    state = a.state()
    expected = a.next(9)  # crosses an epoch boundary
    b = PromptStream(rows, seed=3)
    b.load_state(state)
    assert b.next(9) == expected
    assert a.state() == {"epoch": 1, "index": 7}  # 5 + 9 = 14 = two full epochs of 7; rollover is lazy


def test_prompt_stream_epochs_are_permutations():
    rows = [{"i": i} for i in range(10)]
    s = PromptStream(rows, seed=0)
    first, second = s.next(10), s.next(10)
    assert sorted(r["i"] for r in first) == list(range(10)) and first != second


def test_read_jsonl_errors_name_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "a", "ground_truth": "b"}) + "\n{oops\n")
    with pytest.raises(ConfigError, match=r"d.jsonl' line 2: invalid JSON"):
        read_jsonl(p)
    p.write_text(json.dumps({"ground_truth": "a"}) + "\n")
    with pytest.raises(ConfigError, match=r"line 1: missing key 'prompt' \(or 'messages', a conversation\)"):
        read_jsonl(p)
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}]}) + "\n")
    assert read_jsonl(p)[0]["messages"][0]["content"] == "a"  # a conversation needs no ground truth (sft)


def test_even_slices_give_the_remainder_to_the_first_slices():
    from roll_core.data import even_slices

    assert [(s.start, s.stop) for s in even_slices(7, 3)] == [(0, 3), (3, 5), (5, 7)]
    assert [(s.start, s.stop) for s in even_slices(6, 3)] == [(0, 2), (2, 4), (4, 6)]


def test_update_sorts_tensors_from_other_values():
    b = Batch({"x": torch.zeros(2)}).update(y=torch.ones(2), tags=["a", "b"])
    assert set(b.tensors) == {"x", "y"} and b.non_tensors == {"tags": ["a", "b"]}


def test_concat_pads_2d_to_the_widest_and_joins_1d_and_lists():
    a = Batch({"r": torch.ones(1, 2), "s": torch.tensor([1.0])}, {"t": ["a"]})
    b = Batch({"r": torch.ones(2, 3), "s": torch.tensor([2.0, 3.0])}, {"t": ["b", "c"]})
    out = Batch.concat([a, b])
    assert out["r"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 1]]
    assert out["s"].tolist() == [1.0, 2.0, 3.0] and out.non_tensors["t"] == ["a", "b", "c"]
    single = Batch.concat([a])
    assert single["r"].tolist() == [[1, 1]] and single.non_tensors["t"] == ["a"]


def test_read_jsonl_skips_blank_lines_and_refuses_an_empty_file(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "1", "ground_truth": "a"}\n\n{"prompt": "2", "ground_truth": "b"}\n')
    assert [r["prompt"] for r in read_jsonl(p)] == ["1", "2"]
    p.write_text("\n")
    with pytest.raises(ConfigError, match="has no rows"):
        read_jsonl(p)


def _rows(domain, n):
    return [{"prompt": f"{domain}{i}", "ground_truth": "x", "domain": domain} for i in range(n)]


def test_mixer_deals_each_step_in_proportion_and_resumes():
    rows = _rows("a", 10) + _rows("b", 7) + _rows("c", 5)
    mixer = DomainMixer(rows, {"a": 0.5, "b": 0.25, "c": 0.25}, seed=0)
    for _ in range(5):
        assert Counter(r["domain"] for r in mixer.next(8)) == {"a": 4, "b": 2, "c": 2}
    # Shares that do not divide the step: each step within one prompt, the long run exact.
    thirds = DomainMixer(rows, {"a": 2 / 3, "b": 1 / 3, "c": 0.0}, seed=0)
    total = Counter()
    for _ in range(6):
        step = Counter(r["domain"] for r in thirds.next(5))
        assert abs(step["a"] - 10 / 3) < 1 and "c" not in step
        total += step
    assert total == {"a": 20, "b": 10}
    state = json.loads(json.dumps(thirds.state()))
    expected = thirds.next(7)
    again = DomainMixer(rows, {"a": 2 / 3, "b": 1 / 3, "c": 0.0}, seed=0)
    again.load_state(state)
    assert again.next(7) == expected
    # Resuming mid-cycle, where the credits are not zero, needs them: 4 slots in, a has dealt 3
    # (credit 2/3 * 4 - 3 = -1/3) and b 1 (credit +1/3); the next slot goes to b (credits 1/3 vs
    # 2/3). From zero credits (not restored) it would go to a (2/3 vs 1/3).
    mid = DomainMixer(rows, {"a": 2 / 3, "b": 1 / 3, "c": 0.0}, seed=0)
    mid.next(4)
    state = json.loads(json.dumps(mid.state()))
    assert state["credit"] == pytest.approx({"a": -1 / 3, "b": 1 / 3})
    expected = mid.next(1)
    resumed = DomainMixer(rows, {"a": 2 / 3, "b": 1 / 3, "c": 0.0}, seed=0)
    resumed.load_state(state)
    assert resumed.next(1) == expected and expected[0]["domain"] == "b"


def test_mixer_names_domains_missing_from_the_data_or_the_probabilities():
    rows = _rows("math", 3) + _rows("code", 3)
    with pytest.raises(ConfigError, match="no training row has domain 'mtah'"):
        DomainMixer(rows, {"mtah": 0.5, "code": 0.5}, seed=0)
    with pytest.raises(ConfigError, match="also has domain\\(s\\) 'math'.*0 leaves it out"):
        DomainMixer(rows, {"code": 1.0}, seed=0)


def test_mixer_message_names_both_sides_exactly():
    rows = _rows("math", 2) + [{"prompt": "p", "ground_truth": "x"}]  # no domain: "default"
    with pytest.raises(ConfigError) as err:
        DomainMixer(rows, {"mtah": 0.5, "zz": 0.5, "math": 0, "default": 0}, seed=0)
    assert str(err.value) == ("key 'data.domain_interleave_probs': no training row has domain 'mtah', 'zz'; "
                              "the data has default, math")
    with pytest.raises(ConfigError) as err:
        DomainMixer(_rows("a", 1) + _rows("b", 1) + _rows("c", 1), {"b": 1.0}, seed=0)
    assert str(err.value) == ("key 'data.domain_interleave_probs': the data also has domain(s) 'a', 'c'; "
                              "give each a probability (0 leaves it out)")


def test_mixer_streams_each_domain_alone_with_its_own_seed_and_reports_the_slowest_epoch():
    rows = _rows("a", 4) + _rows("b", 2) + [{"prompt": "p", "ground_truth": "x"}]
    mixer = DomainMixer(rows, {"b": 0.5, "a": 0.5, "default": 0.0}, seed=5)
    assert list(mixer.streams) == ["a", "b"] and mixer.credit == {"a": 0.0, "b": 0.0}
    assert [s.seed for s in mixer.streams.values()] == [5, 5 + 7919]
    assert {r["prompt"] for r in mixer.next_from("b", 2)} == {"b0", "b1"}
    assert mixer.epoch == 0  # b has dealt both rows but rolls over lazily; a has not started
    mixer.next_from("b", 1)
    assert mixer.streams["b"].epoch == 1 and mixer.epoch == 0
    mixer.next_from("a", 4)
    mixer.next_from("a", 1)
    assert mixer.epoch == 1
    state = mixer.state()
    assert state == {"domains": {"a": {"epoch": 1, "index": 1}, "b": {"epoch": 1, "index": 1}},
                     "credit": {"a": 0.0, "b": 0.0}}


def test_deal_slots_is_deficit_round_robin_with_ties_to_the_larger_name():
    credit = {"a": 0.0, "b": 0.0}
    # slot 1: credits .5/.5, tie -> "b" pays; slot 2: 1.0/0 -> "a"; slot 3: .5/.5 -> "b".
    assert deal_slots({"a": 0.5, "b": 0.5}, credit, 3) == {"a": 1, "b": 2}
    assert credit == pytest.approx({"a": 0.5, "b": -0.5})
    credit = {"a": 0.0, "b": 0.0, "c": 0.0}
    # .7/.2/.1 over 4 slots: a, b, a, a (credits after: -.2, -.2, .4: c has waited longest)
    assert deal_slots({"a": 0.7, "b": 0.2, "c": 0.1}, credit, 4) == {"a": 3, "b": 1, "c": 0}
    assert credit == pytest.approx({"a": -0.2, "b": -0.2, "c": 0.4})
    assert deal_slots({"a": 1.0}, {"a": 0.0}, 0) == {"a": 0}


def test_dp_shards_give_each_rank_its_part_of_every_mini_batch_in_order():
    batch = Batch({"x": torch.arange(8)}, {"i": list(range(8))})
    assert dp_shards(batch, 1, 4) == [batch]
    ranks = dp_shards(batch, 2, 4)
    assert [r["x"].tolist() for r in ranks] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [r["i"] for r in ranks] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [r["x"].tolist() for r in dp_shards(batch, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [r["x"].tolist() for r in dp_shards(batch, 4, 8)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_len_select_by_slice_and_concat_of_empty_parts():
    assert len(Batch()) == 0 and len(Batch({}, {"t": ["a", "b"]})) == 2
    b = make_batch(5)
    assert b.select(slice(1, 4, 2))["name"] == ["r1", "r3"]
    assert b.select([4, 0])["x"].tolist() == [[8, 9], [0, 1]]
    assert len(Batch.concat([Batch(), Batch()])) == 0
    joined = Batch.concat([b.select([]), b.select([1])])
    assert joined["name"] == ["r1"] and joined["x"].tolist() == [[2, 3]]


def test_a_pickled_batch_carries_tensors_as_numpy_buffers_and_comes_back_equal():
    import pickle

    import numpy as np

    batch = Batch({"ids": torch.arange(6).view(2, 3), "strided": torch.rand(2, 4)[:, ::2],
                   "bf16": torch.ones(2, 2, dtype=torch.bfloat16), "grad": torch.rand(2, requires_grad=True)},
                  {"prompt": ["a", "b"]})
    buffers = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    # out-of-band: the int64 and float32 tensors (a strided view too) travel as buffers, not through
    # the pickle stream; bfloat16, which numpy lacks, is pickled by torch
    assert len(buffers) == 3 and len(data) < 1500
    back = pickle.loads(data, buffers=buffers)
    for key, tensor in batch.tensors.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor.detach()), key
        assert not back[key].requires_grad
    assert back["prompt"] == ["a", "b"]
    # a read-only buffer (Ray's shared memory) comes back as a writable tensor
    frozen = np.arange(4)
    frozen.flags.writeable = False
    from roll_core.data import _from_wire

    tensor = _from_wire(frozen)
    tensor[0] = 7
    assert int(frozen[0]) == 0


def test_a_group_shares_its_prompt_tokenization_exactly(tiny_model_path):
    """expand_rows tokenizes each row once and repeats it: the same ids and masks as tokenizing
    every sample's prompt, left padding included."""
    from transformers import AutoTokenizer

    from roll_core.rollout.sync import expand_rows, tokenize_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    rows = [{"prompt": p, "ground_truth": str(i), "domain": d}
            for i, (p, d) in enumerate([("1+2=", "math"), ("123+456=", "default"), ("99+1=", "default")])]
    batch = expand_rows(tokenizer, rows, 3)
    ids, mask = tokenize_prompts(tokenizer, [r["prompt"] for r in rows for _ in range(3)])
    assert torch.equal(batch["prompt_ids"], ids) and torch.equal(batch["prompt_mask"], mask)
    assert batch["group_index"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert batch["ground_truth"] == ["0"] * 3 + ["1"] * 3 + ["2"] * 3
    assert batch["domain"][:4] == ["math"] * 3 + ["default"]
    assert batch["prompt_mask"][0].tolist() != batch["prompt_mask"][3].tolist()  # padding differs by row


# -- where a run's rows come from (roll_core.pipelines.sources) ---------------------------------------

def _load(*overrides):
    from roll_core.config import load_config
    from roll_core.embedded.model import build_char_tokenizer
    from roll_core.pipelines.sources import load_rows
    from roll_core.plugins import get_plugins

    return load_rows(load_config(None, list(overrides)).data, get_plugins(), build_char_tokenizer())


def test_rows_come_from_files_with_the_held_out_cut_to_eval_size(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"p{i}", "ground_truth": "x"} for i in range(3)])
    held = write_jsonl(tmp_path / "e.jsonl", [{"prompt": f"q{i}", "ground_truth": "y"} for i in range(5)])
    rows, evals = _load(f"data.train_file={train}", f"data.eval_file={held}", "data.eval_size=2")
    assert [r["prompt"] for r in rows] == ["p0", "p1", "p2"] and [r["prompt"] for r in evals] == ["q0", "q1"]
    assert len(_load(f"data.train_file={train}", f"data.eval_file={held}")[1]) == 5  # no eval_size: every row
    assert _load(f"data.train_file={train}")[1] == []  # no eval_file: nothing held out


def test_each_domains_rows_carry_its_name_and_its_own_held_out_cut(tmp_path):
    """The domain's key names its rows, whatever domain a row said it had; ``eval_size`` cuts each
    domain's held-out rows."""
    files = {}
    for name, n in (("a", 3), ("b", 4)):
        files[name] = (write_jsonl(tmp_path / f"{name}.jsonl", [{"prompt": f"{name}{i}", "ground_truth": "x",
                                                             "domain": "other"} for i in range(2)]),
                       write_jsonl(tmp_path / f"{name}-eval.jsonl", [{"prompt": f"{name}e{i}", "ground_truth": "x"}
                                                                for i in range(n)]))
    domains = ", ".join(f"{k}: {{train_file: {t}, eval_file: {e}}}" for k, (t, e) in files.items())
    rows, evals = _load(f"data.domains={{{domains}}}", "data.eval_size=2")
    assert [(r["prompt"], r["domain"]) for r in rows] == [("a0", "a"), ("a1", "a"), ("b0", "b"), ("b1", "b")]
    assert [(r["prompt"], r["domain"]) for r in evals] == [("ae0", "a"), ("ae1", "a"), ("be0", "b"), ("be1", "b")]


def test_a_datasets_bad_options_are_named_with_their_key():
    with pytest.raises(ConfigError, match="key 'data.options' for dataset 'carry_addition': .*leaves no training"):
        _load("data.options={max_operand: 9, num_eval: 100}")


def test_rows_without_ground_truth_and_domains_no_row_has_are_refused_by_name():
    from roll_core.pipelines.sources import check_domains, check_ground_truth

    check_ground_truth([{"prompt": "1-1=", "ground_truth": 0}], "training")  # an answer of 0 is an answer
    with pytest.raises(ConfigError, match="2 held-out rows have no 'ground_truth' \\(the first: row 1\\)"):
        check_ground_truth([{"ground_truth": "x"}, {}, {"ground_truth": "y"}, {}], "held-out")
    rows = [{"domain": "math"}, {"prompt": "no domain: the default reward's"}]
    check_domains(rows, {"math": None, "default": None})
    with pytest.raises(ConfigError, match="'roles.domain_rewards.maths': no training row has domain 'maths'. "
                                          "Did you mean 'math'\\? The data has: default, math"):
        check_domains(rows, {"maths": None})
