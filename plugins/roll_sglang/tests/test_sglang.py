"""roll-sglang's side of the engine, on the fake SGLang of ``fake_sglang.py`` (SGLang needs CUDA).

What must hold: the sampled tokens' log-probs and ``compute_log_probs`` equal the hf trainer's for the
same weights; a weight update through the core's protocol reaches the engine (and the test sees the
difference when it does not); concurrent calls share the engine and a cancelled call is aborted in
it; colocation releases and resumes the engine's memory; the options and a missing engine are
reported by ``roll validate`` before any worker starts; registering imports no SGLang.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

from roll_core.config import load_and_check
from roll_core.errors import ConfigError
from roll_core.testing import assert_engine_cuts_before_log_probs, assert_engine_matches_trainer, left_padded_prompts

sys.path.insert(0, str(Path(__file__).parent))
import fake_sglang  # noqa: E402


@pytest.fixture
def sglang(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", fake_sglang)
    return fake_sglang


@pytest.fixture
def engine(sglang, tiny_model_path):
    from roll_sglang.strategy import SGLangInferStrategy

    strategy = SGLangInferStrategy(str(tiny_model_path), types.SimpleNamespace(strategy_options={"dtype": "float32"}),
                                   seed=0)
    yield strategy
    strategy.close()


@pytest.fixture(scope="module")
def trainer(tiny_model_path):
    from roll_core.config import load_config
    from roll_core.strategies.hf import HFTrainStrategy

    return HFTrainStrategy(str(tiny_model_path), load_config(None).roles.actor_train, seed=0)


prompts = left_padded_prompts


def trainer_log_probs(trainer, batch, temperature):
    return trainer.forward(batch, ("log_probs",), temperature)["log_probs"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_distributions_equal_the_trainers_for_the_same_weights(engine, trainer, temperature):
    assert_engine_matches_trainer(engine, trainer, temperature, atol=1e-4)


def test_top_k_and_top_p_cut_the_draw_and_leave_the_log_probs_as_the_trainer_computes_them(engine, trainer):
    assert_engine_cuts_before_log_probs(engine, trainer, atol=1e-4)


@contextlib.contextmanager
def engines_with(options: dict):
    """A factory of SGLang strategies on a model directory with ``options``; each is shut down on exit."""
    from roll_sglang.strategy import SGLangInferStrategy

    made = []

    def make(path):
        made.append(SGLangInferStrategy(path, types.SimpleNamespace(strategy_options=options), seed=0))
        return made[-1]

    try:
        yield make
    finally:
        for strategy in made:
            strategy.close()


def test_the_engine_stops_at_the_tokenizers_eos_and_every_config_end_id(engine, tiny_model_path, tmp_path):
    from roll_core.testing import assert_engine_stops_at_every_end_id

    with engines_with({"dtype": "float32"}) as make:
        assert_engine_stops_at_every_end_id(engine, make, tiny_model_path, tmp_path / "m")


def test_a_weight_update_reaches_the_engine(engine, trainer):
    batch = engine.generate(prompts(), max_new_tokens=4, temperature=1.0, top_p=1.0)
    before = engine.compute_log_probs(batch, 1.0)
    with torch.no_grad():  # a training step's worth of change, made directly
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    updated = trainer_log_probs(trainer, batch, 1.0)
    mask = batch["response_mask"]
    assert (before - updated).abs().mul(mask).max() > 1e-2  # the stale engine is told apart
    engine.begin_update(1)
    for bucket in trainer.weight_buckets(2**20):
        engine.load(bucket)
    engine.end_update()
    torch.testing.assert_close(engine.compute_log_probs(batch, 1.0) * mask, updated * mask, atol=1e-4, rtol=0)
    assert engine.engine.calls[-1] == "flush_cache"
    assert set(engine.engine.calls[:-1]) == {"update_weights_from_tensor(flush_cache=False)"}


def test_concurrent_calls_share_the_engine_and_a_cancelled_one_is_aborted(engine, monkeypatch):
    import roll_sglang.strategy as strategy_module

    results = {}

    def call(name, rows):
        results[name] = engine.generate(prompts(rows=rows, seed=rows), max_new_tokens=20, temperature=1.0, top_p=1.0)

    threads = [threading.Thread(target=call, args=(f"t{k}", 3)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(results) == {"t0", "t1"} and engine.engine.max_running > 3  # requests of both calls ran together

    polls = iter([False, True])
    monkeypatch.setattr(strategy_module, "request_cancelled", lambda: next(polls, True))
    out = engine.generate(prompts(rows=4), max_new_tokens=60, temperature=1.0, top_p=1.0)
    assert engine.engine.tokenizer_manager.aborted  # SGLang was told, by request id
    assert out["responses"].shape[0] == 4 and (out["response_mask"].sum(-1) < 60).all()


def test_offload_releases_the_engines_memory_and_reload_resumes_it(engine):
    engine.offload()
    engine.offload()  # twice is once
    assert engine.engine.released
    engine.reload()
    assert engine.engine.calls == ["release_memory_occupation", "resume_memory_occupation"]
    assert engine.generate(prompts(rows=1), max_new_tokens=2, temperature=0.0, top_p=1.0)["responses"].shape[0] == 1


def test_close_stops_the_loop_thread_and_the_engines_processes(engine):
    thread = engine.loop._thread
    engine.close()
    assert not thread.is_alive()
    assert engine.engine.loop.is_closed()  # the fake's shutdown; SGLang's ends its scheduler processes
    with pytest.raises(RuntimeError, match="engine loop"):
        engine.generate(prompts(rows=1), max_new_tokens=2, temperature=0.0, top_p=1.0)


def test_options_and_a_missing_engine_are_reported_by_validate(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # as where SGLang is not installed
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else
                        real_find_spec(name, *a))
    with pytest.raises(ConfigError) as err:
        load_and_check(None, ["roles.actor_infer.strategy=sglang", "roles.actor_infer.strategy_options={tp_sise: 2}"])
    message = str(err.value)
    assert "unknown option 'tp_sise'. Did you mean 'tp_size'?" in message
    assert ("key 'roles.actor_infer.strategy': infer strategy 'sglang' needs the 'sglang' package, which is not "
            "installed: pip install 'roll-sglang[engine]' (CUDA only)") in message


def test_the_engine_gets_the_server_args(sglang, tiny_model_path):
    from roll_sglang.options import SGLangOptions

    args = SGLangOptions(context_length=64, enable_radix_cache=False).engine_kwargs(str(tiny_model_path), 7)
    assert args == {"model_path": str(tiny_model_path), "dtype": "bfloat16", "random_seed": 7, "context_length": 64,
                    "mem_fraction_static": 0.5, "disable_radix_cache": True, "tp_size": 1,
                    "enable_memory_saver": True, "skip_tokenizer_init": True}
    sglang.Engine(**args)  # every key is a server argument


def test_the_plugin_registers_sglang_without_importing_it():
    code = ("import sys; from roll_core.plugins import get_plugins; p = get_plugins(); "
            "assert 'sglang' in p.infer_strategies; assert 'sglang' not in sys.modules; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
