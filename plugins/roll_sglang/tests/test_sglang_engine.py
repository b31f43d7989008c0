"""roll-sglang on the real SGLang engine: runs where sglang imports and a CUDA device is present,
skipped elsewhere with the reason (``pytest -rs`` prints it). The same checks as the fake-engine
tests: log-probs equal the hf trainer's in fp32, and a weight update reaches the engine."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed here (it needs CUDA): pip install 'roll-sglang[engine]'")
if not torch.cuda.is_available():
    pytest.skip("SGLang needs a CUDA device and none is visible", allow_module_level=True)

from test_sglang import engines_with, prompts, trainer_log_probs  # noqa: E402

from roll_core.testing import (assert_engine_cuts_before_log_probs, assert_engine_matches_trainer,  # noqa: E402
                               assert_engine_stops_at_every_end_id)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from roll_sglang.strategy import SGLangInferStrategy

    options = {"dtype": "float32", "context_length": 64, "mem_fraction_static": 0.3, "release_on_offload": False}
    strategy = SGLangInferStrategy(str(tiny_model_path), types.SimpleNamespace(strategy_options=options), seed=0)
    yield strategy
    strategy.close()


@pytest.fixture(scope="module")
def trainer(tiny_model_path):
    from roll_core.config import load_config
    from roll_core.strategies.hf import HFTrainStrategy

    return HFTrainStrategy(str(tiny_model_path), load_config(None).roles.actor_train, seed=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_real_engine_log_probs_equal_the_trainers(engine, trainer, temperature):
    assert_engine_matches_trainer(engine, trainer, temperature, atol=1e-3)


def test_top_k_and_top_p_cut_the_draw_and_leave_the_log_probs_as_the_trainer_computes_them(engine, trainer):
    assert_engine_cuts_before_log_probs(engine, trainer, atol=1e-3)


def test_real_engine_stops_at_the_tokenizers_eos_and_every_config_end_id(engine, tiny_model_path, tmp_path):
    options = {"dtype": "float32", "context_length": 64, "mem_fraction_static": 0.2, "release_on_offload": False}
    with engines_with(options) as make:  # a second engine beside the module's, on the copy
        assert_engine_stops_at_every_end_id(engine, make, tiny_model_path, tmp_path / "m")


def test_real_engine_weight_update(engine, trainer):
    batch = engine.generate(prompts(), max_new_tokens=4, temperature=1.0, top_p=1.0)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    updated = trainer_log_probs(trainer, batch, 1.0)
    engine.begin_update(1)
    for bucket in trainer.weight_buckets(2**20):
        engine.load(bucket)
    engine.end_update()
    mask = batch["response_mask"]
    torch.testing.assert_close(engine.compute_log_probs(batch, 1.0) * mask, updated * mask, atol=1e-3, rtol=0)
