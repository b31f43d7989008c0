"""Checkpoint directories (``pipelines/checkpoint.py``) on their own: what a save writes, what counts
as complete, what is pruned, and what a crash half-way leaves. The pipeline tests reach these
rules only through whole runs that are killed and resumed."""

from __future__ import annotations

import json
import os

import pytest

from roll_core.pipelines.checkpoint import CheckpointManager


def weights(text):
    def write(directory):
        (directory / "weights.bin").write_text(text)
        return {"written_by": text}
    return write


def test_a_save_writes_into_its_step_directory_and_state_json_holds_step_state_and_what_write_returned(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    path = manager.save(7, weights("w7"), {"stream": {"epoch": 1}})
    assert path == tmp_path / "checkpoints" / "step_000007"
    assert (path / "weights.bin").read_text() == "w7"
    assert json.loads((path / "state.json").read_text()) == CheckpointManager.load_state(path) == {
        "step": 7, "stream": {"epoch": 1}, "written_by": "w7"}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000007"]  # no temporary left
    assert manager.save(8, lambda d: None, {"a": 1}) and manager.load_state(manager.latest()) == {"step": 8, "a": 1}


def test_only_the_newest_keep_checkpoints_stay(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (10, 2, 30):
        manager.save(step, weights(f"w{step}"), {})
    assert [step for step, _ in manager.complete()] == [10, 30]  # by step, not by the order of saving
    assert manager.latest() == tmp_path / "step_000030"
    CheckpointManager(tmp_path, keep=1).save(40, weights("w40"), {})
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["step_000040"]


def test_complete_means_a_step_directory_with_its_state_json(tmp_path):
    manager = CheckpointManager(tmp_path / "none")
    assert manager.complete() == [] and manager.latest() is None
    assert manager.resume_point() == "the start (no checkpoint yet)"
    manager = CheckpointManager(tmp_path)
    manager.save(3, weights("w3"), {})
    (tmp_path / "step_000009").mkdir()  # killed before state.json was written
    (tmp_path / "step_000012.tmp-99").mkdir()
    (tmp_path / "step_000011.tmp-99").mkdir()
    (tmp_path / "step_000011.tmp-99" / "state.json").write_text("{}")
    (tmp_path / "notes_000013").mkdir()
    (tmp_path / "notes_000013" / "state.json").write_text("{}")
    assert manager.complete() == [(3, tmp_path / "step_000003")]
    assert manager.resume_point() == f"the last checkpoint, {tmp_path / 'step_000003'}"


def test_a_save_that_fails_half_way_leaves_the_previous_checkpoint_and_the_next_save_clears_the_leftover(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, weights("w1"), {})

    def crash(directory):
        (directory / "weights.bin").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        manager.save(2, crash, {})
    assert manager.latest() == tmp_path / "step_000001"
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == [f"step_000002.tmp-{os.getpid()}"]
    manager.save(3, weights("w3"), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000003"]


def test_saving_a_step_again_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(5, weights("before"), {"k": 1})
    (tmp_path / "step_000005" / "extra.bin").write_text("old file")
    manager.save(5, weights("after"), {"k": 2})
    assert (tmp_path / "step_000005" / "weights.bin").read_text() == "after"
    assert not (tmp_path / "step_000005" / "extra.bin").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["step_000005"]
    assert manager.load_state(tmp_path / "step_000005") == {"step": 5, "k": 2, "written_by": "after"}


def test_what_write_returns_wins_over_the_state_it_was_given(tmp_path):
    """A strategy's own record of its files (what ``write`` returns) is the last word on them."""
    path = CheckpointManager(tmp_path).save(1, lambda d: {"format": "sharded"}, {"format": "full", "seed": 3})
    assert CheckpointManager.load_state(path) == {"step": 1, "format": "sharded", "seed": 3}
