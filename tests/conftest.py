"""Shared helpers. roll's own fixtures (roll_plugins, tiny_model_path, tiny_config) come from
``roll_core.testing`` through the pytest11 entry point, as they do for plugin authors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from roll_core.testing import hooks


def resume_hf_style_checkpoint(strategy_cls, model_path, cfg, directory: Path) -> tuple:
    """A trainer of ``strategy_cls`` (the ``hf`` strategy or one that checkpoints like it) passes
    ``assert_checkpoint_resumes_exactly`` in ``directory``, its model is saved as safetensors, and the
    one built with seed 1 resumed the sampling generator of seed 0's. Returns (saved, resumed)."""
    import torch

    from roll_core.testing import assert_checkpoint_resumes_exactly

    made = []

    def make_trainer(seed):
        made.append(strategy_cls(str(model_path), cfg.roles.actor_train, seed=seed))
        return made[-1]

    assert_checkpoint_resumes_exactly(make_trainer, cfg, directory)
    assert (directory / "model" / "model.safetensors").is_file()
    saved = torch.load(directory / "train_state.pt", weights_only=False)["generator"]
    assert torch.equal(made[1].rng_state(), saved)
    assert not torch.equal(saved, torch.Generator(device="cpu").manual_seed(1).get_state())
    return made[0], made[1]


def make_fake_distribution(root: Path, dist: str, module_name: str, source: str, version: str = "0.0.1") -> Path:
    """Write an importable module plus a ``*.dist-info`` declaring it under the ``roll`` entry-point
    group, as ``pip install`` would. Putting ``root`` on ``PYTHONPATH`` makes importlib.metadata find it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module_name}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[roll]\n{module_name} = {module_name}\n")
    (info / "RECORD").write_text("")
    return root


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """``rows`` as a JSONL file at ``path`` (a data file, a run's metrics), one object per line."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def metrics_of(run_dir: str | Path) -> list[dict]:
    """The rows of a run's ``metrics.jsonl``, as the jsonl tracker wrote them (one per logged step)."""
    from roll_core.trackers import read_metrics

    return read_metrics(Path(run_dir) / "metrics.jsonl")


def run_roll(*args: str, env_extra: dict | None = None, cwd=None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "roll_core.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


def proc_stat(pid: int) -> list[str] | None:
    """Process ``pid``'s /proc/<pid>/stat fields from field 3 (its state) on, so that field n is at
    index n - 3: the command name before them may hold spaces (None once it has exited)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def proc_cmdline(pid: int) -> str | None:
    """Process ``pid``'s command line from /proc, arguments joined by spaces (None once it has exited)."""
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


@pytest.fixture
def fake_dist(tmp_path):
    def make(dist, module_name, source, version="0.0.1"):
        return make_fake_distribution(tmp_path / "site", dist, module_name, source, version)

    return make


@pytest.fixture
def plain_train_strategy(roll_plugins):
    """Plugins with one more train strategy, ``plain`` (the ``hf`` trainer registered without any
    capability flag: no packed sequences, no compiling, no LoRA), for the checks that refuse a
    config asking a strategy for what it did not register."""
    def roll_register_strategies(register):
        register("plain", "roll_core.strategies.hf:HFTrainStrategy", kind="train")

    return roll_plugins(("t", hooks(roll_register_strategies=roll_register_strategies)))


# -- packed forward passes (roll_core.strategies.packing, packed_attention) -------------------------
def two_prompt_groups():
    """Prompt A = [5, 6, 7] sampled twice (answers [10, 11] and [12]), prompt B = [8, 9] once ([13, 14, 15])."""
    import torch

    from roll_core.data import Batch

    return Batch({"prompt_ids": torch.tensor([[5, 6, 7], [5, 6, 7], [0, 8, 9]]),
                  "prompt_mask": torch.tensor([[1, 1, 1], [1, 1, 1], [0, 1, 1]]),
                  "responses": torch.tensor([[10, 11, 0], [12, 0, 0], [13, 14, 15]]),
                  "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])})


def packed_rows(batch, max_length: int = 1024):
    """``batch``'s padded layout packed into rows of at most ``max_length`` (pad id 0)."""
    from roll_core.strategies.packing import pack_sequences

    return pack_sequences(batch["prompt_ids"], batch["prompt_mask"], batch["responses"], batch["response_mask"],
                          max_length=max_length, pad_token_id=0)


@pytest.fixture
def every_row_by_pieces(monkeypatch):
    """Packed rows of any width attend piece by piece, on a GPU too (the tests' rows are narrower
    than ``packed_attention.MIN_WIDTH``, so by default they attend densely)."""
    from roll_core.strategies import packed_attention

    monkeypatch.setattr(packed_attention, "MIN_WIDTH", 0)
    monkeypatch.setattr(packed_attention, "DEVICE_TYPES", ("cpu", "cuda"))
    monkeypatch.setattr(packed_attention, "MIN_SAVING", 0.0)
