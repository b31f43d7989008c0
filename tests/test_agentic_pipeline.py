"""The ``agentic`` pipeline end to end on the tiny model: it plays, trains, validates on held-out
seeds, and an environment that raises costs its episode only, counted in the metrics."""

from __future__ import annotations

import json
import os
import threading
import time
import types
from pathlib import Path

import pytest

from roll_core import hookimpl
from roll_core.envs import Env


class Echo(Env):
    """Reward 1 when the reply starts with the letter the observation names; 2 turns."""

    def reset(self, seed=None):
        self.seed, self.n = seed or 0, 0
        self.letter = "abc"[self.seed % 3]
        return f"say {self.letter}", {"state_hash": self.seed % 3}

    def step(self, action):
        if self.seed % 5 == 4 and self.n == 1:
            raise RuntimeError("the simulator crashed")
        self.n += 1
        hit = action.strip().startswith(self.letter)
        return f"say {self.letter}", float(hit), self.n >= 2, False, {"success": hit, "state_hash": self.seed % 3}


def test_agentic_runs_trains_validates_and_survives_a_raising_environment(roll_plugins, tiny_config):
    from roll_core.pipelines.agentic import AgenticPipeline
    from roll_core.runtime.executor import LocalExecutor

    roll_plugins(("echo", types.SimpleNamespace(roll_register_envs=hookimpl(lambda register: register("echo", Echo)))))
    cfg = tiny_config("pipeline=agentic", "agentic.env=echo", "warmup.steps=0", "algorithm.advantage_estimator=gigpo",
                      "trainer.max_steps=3", "trainer.eval_every=3", "agentic.groups_per_step=5", "agentic.group_size=2",
                      "agentic.validation_episodes=6", "rollout.max_new_tokens=3", "trainer.dump_rollouts_every=3")
    summary = AgenticPipeline(cfg, LocalExecutor()).run()
    assert summary["steps"] == 3 and "eval/success_rate" in summary["before"] and "eval/success_rate" in summary["after"]
    from roll_core.pipelines.rollout_dump import dumped_steps, show

    assert dumped_steps(Path(cfg.output_dir)) == [3]
    shown = show(Path(cfg.output_dir), limit=None)  # an episode: the policy's turns and the environment's replies
    assert shown.count("--- sample") == 10 and "  environment 'say " in shown and "  policy      '" in shown
    rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 3
    # seeds 1,000,000 + g: g = 4 (step 1) and g = 9, 14 (steps 2, 3) crash at their second turn
    assert [r["episode/failed"] for r in steps] == [2.0, 2.0, 2.0]
    assert all("train/pg_loss" in r and 0 < r["episode/turns_mean"] <= 2 for r in steps)


def test_agentic_resumes_from_its_checkpoint(roll_plugins, tiny_config):
    from roll_core.pipelines.agentic import AgenticPipeline
    from roll_core.runtime.executor import LocalExecutor

    roll_plugins(("echo", types.SimpleNamespace(roll_register_envs=hookimpl(lambda register: register("echo", Echo)))))
    common = ["pipeline=agentic", "agentic.env=echo", "warmup.steps=0", "agentic.groups_per_step=2",
              "agentic.group_size=2", "agentic.validation_episodes=3", "rollout.max_new_tokens=2", "trainer.save_every=2"]
    AgenticPipeline(tiny_config(*common, "trainer.max_steps=2"), LocalExecutor()).run()
    cfg = tiny_config(*common, "trainer.max_steps=3")
    summary = AgenticPipeline(cfg, LocalExecutor()).run()
    steps = [json.loads(line)["step"] for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and steps.count(3) >= 1 and steps.count(1) == 1  # step 3 after the resume only


class Flaky(Echo):
    """Echo without its crash, but seeds with seed % 4 == 1 hang at their first step, and % 4 == 2 raise there."""

    def step(self, action):
        if self.seed % 4 == 1:
            threading.Event().wait()  # forever: only the step timeout gets the run past it
        if self.seed % 4 == 2:
            raise ValueError("bad state")
        self.n += 1
        hit = action.strip().startswith(self.letter)
        return f"say {self.letter}", float(hit), self.n >= 2, False, {"success": hit, "state_hash": self.seed % 3}


@pytest.mark.parametrize("rollout", ["sync", "async"])
def test_a_raising_and_a_hanging_environment_fail_their_episodes_and_the_run_finishes(roll_plugins, tiny_config,
                                                                                      rollout):
    from roll_core.pipelines.agentic import AgenticPipeline
    from roll_core.runtime.executor import LocalExecutor

    roll_plugins(("flaky", types.SimpleNamespace(roll_register_envs=hookimpl(lambda register: register("flaky", Flaky)))))
    cfg = tiny_config("pipeline=agentic", "agentic.env=flaky", "warmup.steps=0", f"agentic.rollout={rollout}",
                      "agentic.step_timeout_s=0.5", "roles.env.num_workers=2", "trainer.max_steps=3",
                      "agentic.groups_per_step=4", "agentic.group_size=2", "agentic.validation_episodes=0",
                      "rollout.max_new_tokens=2")
    t0 = time.perf_counter()
    summary = AgenticPipeline(cfg, LocalExecutor()).run()
    assert summary["steps"] == 3
    rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    # each step's 4 groups (seeds g = 0..3 of the step, x2 episodes): one hangs, one raises, both fail
    assert [r["episode/hung"] for r in steps] == [2.0, 2.0, 2.0]
    assert [r["episode/failed"] for r in steps] == [4.0, 4.0, 4.0]
    assert all("train/pg_loss" in r for r in steps)
    assert time.perf_counter() - t0 < 60  # hung steps cost their timeout, not forever


@pytest.mark.ray
def test_agentic_on_ray_with_env_workers(tiny_config):
    """FrozenLake (installed: Ray workers find it through its entry point) on two env-worker actors;
    async rollout, whose slots call the actors from many threads at once (sync makes the same calls)."""
    from roll_core.pipelines.agentic import AgenticPipeline
    from roll_core.runtime.executor import make_executor

    cfg = tiny_config("pipeline=agentic", "executor=ray", "agentic.env=frozen_lake", "warmup.steps=2",
                      "warmup.batch_size=4", "agentic.rollout=async", "agentic.role=lake_workers",
                      "roles.lake_workers={kind: env, num_workers: 2}",  # an env role of one's own
                      "agentic.groups_per_step=2", "agentic.group_size=2", "agentic.validation_episodes=4",
                      "trainer.max_steps=2", "rollout.max_new_tokens=2", "roles.reference=null",
                      "rollout.async_generation_ratio=1")
    executor = make_executor(cfg)
    try:
        pipeline = AgenticPipeline(cfg, executor)
        summary = pipeline.run()
        pids = {executor.get(executor.invoke(slot.handle, "pid", (), {})) for slot in pipeline.lanes[0].slots}
    finally:
        executor.shutdown()
    assert summary["steps"] == 2 and len(pids) == 2 and os.getpid() not in pids  # two actors, not the driver
    rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["warmup/loss"] > 0 and "eval/success_rate" in rows[0]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 2 and all(r["episode/failed"] == 0 and "train/pg_loss" in r for r in steps)


def test_a_warm_up_needs_an_environment_with_an_expert(roll_plugins, tiny_config):
    from roll_core.errors import ConfigError
    from roll_core.pipelines.agentic import AgenticPipeline
    from roll_core.runtime.executor import LocalExecutor

    roll_plugins(("echo", types.SimpleNamespace(roll_register_envs=hookimpl(lambda register: register("echo", Echo)))))
    cfg = tiny_config("pipeline=agentic", "agentic.env=echo", "warmup.steps=3")
    with pytest.raises(ConfigError, match="imitates the environment's expert, and 'echo' has none"):
        AgenticPipeline(cfg, LocalExecutor()).run()


class EchoWithExpert(Echo):
    def expert_action(self):
        return self.letter


def test_a_noisy_teacher_needs_actions_to_draw_from(roll_plugins, tiny_config):
    from roll_core.errors import ConfigError
    from roll_core.pipelines.agentic import AgenticPipeline
    from roll_core.runtime.executor import LocalExecutor

    roll_plugins(("echo", types.SimpleNamespace(
        roll_register_envs=hookimpl(lambda register: register("echo", EchoWithExpert)))))
    cfg = tiny_config("pipeline=agentic", "agentic.env=echo", "warmup.steps=3", "agentic.teacher_noise=0.2")
    with pytest.raises(ConfigError, match="'echo' lists none; set agentic.teacher_noise=0"):
        AgenticPipeline(cfg, LocalExecutor()).run()


@pytest.mark.parametrize("rollout", ["sync", "async"])
def test_several_environments_train_together_with_metrics_per_environment(roll_plugins, tiny_config, rollout):
    from roll_core.pipelines.agentic import AgenticPipeline
    from roll_core.runtime.executor import LocalExecutor

    roll_plugins(("two", types.SimpleNamespace(roll_register_envs=hookimpl(
        lambda register: [register("echo", Echo), register("flaky", Flaky)]))))
    envs = ("[{env: echo, groups_per_step: 2, validation_episodes: 5}, "
            "{env: flaky, name: shaky, groups_per_step: 4, instruction: 'go '}]")
    cfg = tiny_config("pipeline=agentic", f"agentic.envs={envs}", "warmup.steps=0", f"agentic.rollout={rollout}",
                      "agentic.step_timeout_s=0.5", "trainer.max_steps=3", "trainer.eval_every=3",
                      "agentic.group_size=2", "agentic.validation_episodes=0", "rollout.max_new_tokens=2")
    summary = AgenticPipeline(cfg, LocalExecutor()).run()
    assert summary["steps"] == 3
    rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    # echo: seeds 1,000,000 + g, g = 0..5 over three steps; g = 4 (step 3) crashes at its second turn.
    # shaky: of each step's 4 groups, one hangs and one raises (Flaky's seeds % 4).
    assert [r["episode/echo/failed"] for r in steps] == [0.0, 0.0, 2.0]
    assert [r["episode/shaky/hung"] for r in steps] == [2.0, 2.0, 2.0]
    assert [r["episode/shaky/failed"] for r in steps] == [4.0, 4.0, 4.0]
    assert [r["episode/failed"] for r in steps] == [4.0, 4.0, 6.0]
    assert all(r["episode/echo/turns_mean"] > 0 and "train/pg_loss" in r for r in steps)
    # validation: echo's 5 held-out seeds only (shaky inherits validation_episodes=0)
    assert "eval/echo/success_rate" not in summary["after"] and "eval/success_rate" in summary["after"]


def test_episodes_of_different_environments_never_share_a_group():
    from roll_core.agentic.samples import Episode
    from roll_core.pipelines.agentic import distinct_groups

    episodes = [Episode([], g, env=env) for env, g in [("a", 0), ("a", 0), ("b", 0), ("a", 1), ("b", 0), ("b", 7)]]
    assert [e.group for e in distinct_groups(episodes)] == [0, 0, 1, 2, 1, 3]


def test_the_environments_are_named_one_way_only_and_their_labels_differ(tiny_config):
    from roll_core.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="either agentic.env"):
        tiny_config("pipeline=agentic", "agentic.env=echo", "agentic.envs=[{env: flaky}]")
    with pytest.raises((ConfigError, ValueError), match="repeat"):
        tiny_config("pipeline=agentic", "agentic.envs=[{env: echo}, {env: echo}]")
    cfg = tiny_config("pipeline=agentic", "agentic.envs=[{env: echo}, {env: echo, name: echo2, max_turns: 3}]")
    first, second = cfg.agentic.environments()
    assert (first.label, first.max_turns, second.label, second.max_turns) == ("echo", 10, "echo2", 3)
