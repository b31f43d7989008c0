"""The ``async`` scheduler's invariants: staleness never exceeds the ratio, batches hold complete
groups only, filtered groups never reach training, and nothing is left in flight after a run."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest

from roll_core import hookimpl
from roll_core.config import load_and_check
from roll_core.errors import ConfigError
from roll_core.pipelines.rlvr import RLVRPipeline
from roll_core.rewards import Reward
from roll_core.runtime import make_executor


class RecordingPipeline(RLVRPipeline):
    """Keeps every batch handed to the trainer."""

    def collect(self):
        batch, metrics = super().collect()
        self.trained_batches = getattr(self, "trained_batches", []) + [batch]
        return batch, metrics


def _run(cfg, before_shutdown=None):
    executor = make_executor(cfg)
    try:
        pipeline = RecordingPipeline(cfg, executor)
        pipeline.run()
        if before_shutdown:
            before_shutdown(pipeline)
    finally:
        executor.shutdown()
    rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return pipeline, [r for r in rows if r["step"] > 0]


ASYNC = ["rollout.scheduler=async", "rollout.request_size=4", "rollout.max_running_requests=2",
         "warmup.steps=5", "trainer.max_steps=6"]


@pytest.mark.parametrize("ratio", [0, 0.5, 1, 2])
def test_staleness_never_exceeds_the_ratio(tiny_config, ratio):
    pipeline, steps = _run(tiny_config(*ASYNC, f"rollout.async_generation_ratio={ratio}"))
    bound = math.ceil(ratio)
    want = pipeline.config.rollout.prompts_per_step
    for step in steps:
        assert step["rollout/staleness_max"] <= bound
        assert sum(step.get(f"rollout/staleness_{k}", 0) for k in range(bound + 1)) == want
    later = steps[bound:]  # once generation has had time to run ahead
    if ratio == 0:
        assert all(s["rollout/staleness_0"] == want for s in steps)
    elif ratio == 0.5:  # half a batch generated ahead, one step stale
        assert all(s["rollout/staleness_1"] == want // 2 for s in later)
    else:  # it does run ahead, up to the bound (how far depends on how many requests fit in flight)
        assert any(s[f"rollout/staleness_{bound}"] > 0 for s in later)


def test_every_batch_holds_complete_groups(tiny_config):
    pipeline, _ = _run(tiny_config(*ASYNC, "rollout.async_generation_ratio=1",
                                   "rollout.max_additional_running_prompts=3"))
    n = pipeline.config.rollout.num_return_sequences
    want = pipeline.config.rollout.prompts_per_step
    for batch in pipeline.trained_batches:
        assert batch["group_index"].tolist() == [g for g in range(want) for _ in range(n)]
        for g in range(want):
            prompts = {p for p, i in zip(batch["prompt"], batch["group_index"].tolist()) if i == g}
            assert len(prompts) == 1  # one prompt per group, all of its samples


class ParityReward(Reward):
    """Prompts whose first operand is even: every sample scores 1 (a uniform group the mean filter
    drops). Odd: 1 for responses with an even last digit, so those groups are usually mixed."""

    def score(self, sample):
        if int(sample.prompt[:2]) % 2 == 0:
            return 1.0
        digits = [c for c in sample.response if c.isdigit()]
        return float(bool(digits) and int(digits[-1]) % 2 == 0)


def test_filtered_groups_never_reach_training(tiny_config, roll_plugins):
    roll_plugins(("parity", types.SimpleNamespace(
        roll_register_rewards=hookimpl(lambda register: register("parity", ParityReward)))))
    pipeline, steps = _run(tiny_config(*ASYNC, "rollout.async_generation_ratio=1", "roles.reward.name=parity",
                                       "algorithm.dynamic_sampling.filter=mean",
                                       "rollout.max_additional_running_prompts=4"))
    n = pipeline.config.rollout.num_return_sequences
    for batch in pipeline.trained_batches:
        scores = batch["scores"].view(-1, n)
        assert bool(((scores.min(1).values < 1) & (scores.max(1).values > 0)).all()), scores
        assert all(int(p[:2]) % 2 == 1 for p in batch["prompt"])
    assert sum(s["rollout/filtered_groups"] for s in steps) > 0
    assert not any("dynamic_sampling/fallback_groups" in s for s in steps)


def test_nothing_left_in_flight_after_the_run(tiny_config):
    pipeline, steps = _run(tiny_config(*ASYNC, "rollout.async_generation_ratio=2",
                                       "rollout.max_additional_running_prompts=2"))
    scheduler = pipeline.scheduler
    assert scheduler.requests == [] and scheduler.scoring == [] and scheduler.ready == []
    assert scheduler.stats["rollout/aborted_groups"] > 0  # the prefetched batches were discarded


@pytest.mark.ray
def test_async_on_ray_overlaps_and_keeps_the_bound(tiny_config):
    pids = []
    # every inference worker answers at once after the run: no request is still queued on it
    pipeline, steps = _run(tiny_config(*ASYNC, "executor=ray", "torch_threads=1", "rollout.async_generation_ratio=1",
                                       "roles.actor_infer.num_workers=2"),
                           before_shutdown=lambda p: pids.extend(p.executor.get(p.infer.call("pid"))))
    for prev, step in zip([None, *steps], steps):
        assert step["rollout/staleness_max"] <= 1
        # per-role idle time: the trainer's within its step; the inference workers' since the last
        # batch was handed out (at most the previous step's end and this one)
        assert 0 <= step["time/idle/actor_train_s"] < step["time/step_s"]
        window = step["time/step_s"] + (prev["time/step_s"] if prev else 0.0)
        assert 0 <= step["time/idle/actor_infer_s"] <= window
    assert sum(s["rollout/staleness_1"] for s in steps) > 0
    assert pipeline.scheduler.requests == [] and pipeline.scheduler.scoring == []
    assert len(set(pids)) == 2


@pytest.mark.parametrize("overrides, message", [
    (["rollout.async_generation_ratio=1"], "needs rollout.scheduler: async"),
    (["rollout.scheduler=async", "rollout.request_size=6", "rollout.num_return_sequences=4"],
     "must be a multiple of num_return_sequences"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_and_check(None, overrides)


def test_oversubscribed_cpu_cores_are_warned_about(capsys, monkeypatch):
    import os

    from roll_core.pipelines.rlvr import _warn_if_oversubscribed

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    _warn_if_oversubscribed(load_and_check(None, ["rollout.scheduler=async", "torch_threads=2"]))
    assert "Set torch_threads=1 or fewer" in capsys.readouterr().out
    _warn_if_oversubscribed(load_and_check(None, ["rollout.scheduler=async", "torch_threads=1"]))
    assert capsys.readouterr().out == ""


def test_async_workers_wait_passively_unless_the_user_chose_a_policy(monkeypatch):
    from roll_core.runtime.executor import _worker_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert _worker_env(load_and_check(None, ["rollout.scheduler=async"])) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert _worker_env(load_and_check(None, [])) == {}  # sync: spinning is faster there
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert _worker_env(load_and_check(None, ["rollout.scheduler=async"])) == {}


def test_a_stalled_scheduler_raises_instead_of_spinning():
    from roll_core.errors import RollError
    from roll_core.rollout.async_scheduler import AsyncRolloutScheduler
    from roll_core.runtime.executor import LocalExecutor

    cfg = load_and_check(None, ["rollout.scheduler=async"])
    scheduler = AsyncRolloutScheduler(cfg, LocalExecutor(), [object()], None, None)
    scheduler.accepting = False  # as if admission had closed with nothing in flight
    with pytest.raises(RollError, match="stalled at step 1: 0 of 32 groups, nothing in flight"):
        scheduler.next_batch()
