import json

import pytest
import torch

from roll_core.data import Batch, PromptStream, read_jsonl
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
    p.write_text(json.dumps({"prompt": "a"}) + "\n")
    with pytest.raises(ConfigError, match="line 1: missing key 'ground_truth'"):
        read_jsonl(p)


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
