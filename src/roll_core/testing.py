"""pytest fixtures for roll and for plugin authors (registered through the ``pytest11`` entry point).

* ``roll_plugins(*plugins)``: a fresh plugin manager with the installed plugins plus the given
  ``(name, object)`` pairs, installed as the process-wide one for the duration of the test.
* ``tiny_model_path``: the embedded tiny model, built once per test session.
* ``tiny_config(**overrides)``: a validated quickstart config shrunk to a few fast steps.
* ``left_padded_prompts(...)``: a batch of prompts in roll's layout, for inference-engine tests.
* ``assert_engine_matches_trainer(engine, trainer, temperature, atol)``: the contract of an
  inference strategy's log-probs, for engine plugins' tests.
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


def left_padded_prompts(rows: int = 6, width: int = 5, seed: int = 0):
    """A :class:`~roll_core.data.Batch` of ``rows`` left-padded prompts ``[rows, width]`` of three
    different lengths, BOS (id 1) first, random tokens of the tiny model's vocabulary after it."""
    import torch

    from roll_core.data import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for i in range(rows):
        n = width - (i % 3)
        ids[i, width - n:] = torch.cat([torch.tensor([1]), torch.randint(5, 90, (n - 1,), generator=g)])
        mask[i, width - n:] = 1
    return Batch({"prompt_ids": ids, "prompt_mask": mask})


def assert_engine_matches_trainer(engine, trainer, temperature: float, atol: float, max_new_tokens: int = 6):
    """An inference strategy's sampled-token log-probs, its ``compute_log_probs`` and its full
    distributions equal the training strategy's for the same weights (within ``atol``), on
    :func:`left_padded_prompts`. The sampled tokens' log-probs are those of the distribution they
    were drawn from (after temperature), as the trainer computes them."""
    import torch

    batch = engine.generate(left_padded_prompts(), max_new_tokens=max_new_tokens, temperature=temperature,
                            top_p=1.0)
    mask = batch["response_mask"]
    assert batch["responses"].shape == mask.shape == batch["infer_log_probs"].shape and mask.sum() > 0
    expected = trainer.forward(batch, ("log_probs",), temperature)["log_probs"]
    torch.testing.assert_close(batch["infer_log_probs"] * mask, expected * mask, atol=atol, rtol=0)
    torch.testing.assert_close(engine.compute_log_probs(batch, temperature) * mask, expected * mask, atol=atol, rtol=0)
    small = batch.select(slice(0, 2))  # full distributions [2, R, V]
    dist_mask = small["response_mask"][..., None]
    expected_dist = trainer.forward(small, ("log_dist",), temperature)["log_dist"]
    got = engine.compute_log_probs(small, temperature, distribution=True)
    torch.testing.assert_close(got * dist_mask, expected_dist * dist_mask, atol=atol, rtol=0)
