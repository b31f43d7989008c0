"""pytest fixtures for roll and for plugin authors (registered through the ``pytest11`` entry point).

* ``roll_plugins(*plugins)``: a fresh plugin manager with the installed plugins plus the given
  ``(name, object)`` pairs, installed as the process-wide one for the duration of the test.
* ``tiny_model_path``: the embedded tiny model, built once per test session.
* ``tiny_config(**overrides)``: a validated quickstart config shrunk to a few fast steps.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def roll_plugins():
    from roll_core.plugins import load_plugins, reset_plugins

    def make(*extra, entry_points: bool = True):
        plugins = load_plugins(list(extra), entry_points=entry_points)
        reset_plugins(plugins)
        return plugins

    yield make
    reset_plugins(None)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    from roll_core.embedded.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("roll-tiny") / "model")


@pytest.fixture
def tiny_config(tmp_path):
    """A factory for small, fast configs: a handful of steps on a handful of prompts."""
    from roll_core.config import load_config

    def make(*overrides: str):
        base = [
            f"output_dir={tmp_path / 'run'}", "executor=local", "warmup.steps=5",
            "rollout.prompts_per_step=4", "rollout.num_return_sequences=4", "trainer.max_steps=3",
            "trainer.eval_every=0", "trainer.save_every=0", "data.eval_size=16", "trackers=[jsonl]",
        ]
        return load_config(None, base + list(overrides))

    return make
