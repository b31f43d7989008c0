"""Shared helpers. roll's own fixtures (roll_plugins, tiny_model_path, tiny_config) come from
``roll_core.testing`` through the pytest11 entry point, as they do for plugin authors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from roll_core import hookimpl


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


def run_roll(*args: str, env_extra: dict | None = None, cwd=None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "roll_core.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


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

    return roll_plugins(("t", types.SimpleNamespace(roll_register_strategies=hookimpl(roll_register_strategies))))
