"""The ``agentic`` pipeline end to end on the tiny model: it plays, trains, validates on held-out
seeds, and an environment that raises costs its episode only, counted in the metrics."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from conftest import metrics_of

from roll_core.envs import Env
from roll_core.testing import hooks


class Echo(Env):
    """Reward 1 when the reply starts with the letter the observation names; 2 turns. Records
    every environment built and every close."""

    built: list = []
    closed: list = []

    def __init__(self):
        Echo.built.append(self)

    def close(self):
        Echo.closed.append(self)

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

    roll_plugins(("echo", hooks(roll_register_envs=lambda register: register("echo", Echo))))
    Echo.built, Echo.closed = [], []
    cfg = tiny_config("pipeline=agentic", "agentic.env=echo", "warmup.steps=0", "algorithm.advantage_estimator=gigpo",
                      "trainer.max_steps=3", "trainer.eval_every=3", "agentic.groups_per_step=5", "agentic.group_size=2",
                      "agentic.validation_episodes=6", "rollout.max_new_tokens=3", "trainer.dump_rollouts_every=3")
    executor = LocalExecutor()
    summary = AgenticPipeline(cfg, executor).run()
    # Closed by the run's end: each environment that crashed, and the validation ones (in the driver,
    # 6 slots); the training slots' are the executor's, closed when it stops (the launcher's job).
    probe, played = Echo.built[0], Echo.built[1:]  # the probe checks the options before any worker
    crashed = [e for e in played if e.seed % 5 == 4]
    validation = [e for e in played if e.seed < 6 and e not in crashed]
    # seeds 1,000,004, 9, 14, two episodes each (a group), and seed 4 in both evaluations
    assert len(crashed) == 8 and len(validation) == 5
    assert sorted(map(id, Echo.closed)) == sorted(map(id, [probe, *crashed, *validation]))
    executor.shutdown()
    assert sorted(map(id, Echo.closed)) == sorted(map(id, Echo.built))  # each once
    assert summary["steps"] == 3 and "eval/success_rate" in summary["before"] and "eval/success_rate" in summary["after"]
    from roll_core.pipelines.rollout_dump import dumped_steps, show

    assert dumped_steps(Path(cfg.output_dir)) == [3]
    shown = show(Path(cfg.output_dir), limit=None)  # an episode: the policy's turns and the environment's replies
    assert shown.count("--- sample") == 10 and "  environment 'say " in shown and "  policy      '" in shown
    rows = metrics_of(cfg.output_dir)
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 3
    # seeds 1,000,000 + g: g = 4 (step 1) and g = 9, 14 (steps 2, 3) crash at their second turn
    assert [r["episode/failed"] for r in steps] == [2.0, 2.0, 2.0]
    assert all("train/pg_loss" in r and 0 < r["episode/turns_mean"] <= 2 for r in steps)


def test_agentic_resumes_from_its_checkpoint(roll_plugins, tiny_config):
    from roll_core.pipelines.agentic import AgenticPipeline
    from roll_core.runtime.executor import LocalExecutor

    # three warm-up steps on the expert: the checkpoint's weights are not the model a new run builds,
    # so a resume that did not load them shows in the step's entropy and log-prob gap
    roll_plugins(("echo", hooks(roll_register_envs=lambda register: register("echo", EchoWithExpert))))
    common = ["pipeline=agentic", "agentic.env=echo", "warmup.steps=3", "agentic.teacher_noise=0", "agentic.groups_per_step=2",
              "agentic.group_size=2", "agentic.validation_episodes=3", "rollout.max_new_tokens=2", "trainer.save_every=2"]
    AgenticPipeline(tiny_config(*common, "trainer.max_steps=2"), LocalExecutor()).run()
    cfg = tiny_config(*common, "trainer.max_steps=3")
    summary = AgenticPipeline(cfg, LocalExecutor()).run()
    rows = metrics_of(cfg.output_dir)
    steps = [r["step"] for r in rows]
    assert summary["steps"] == 3 and steps.count(3) >= 1 and steps.count(1) == 1  # step 3 after the resume only
    straight = tiny_config(*common, "trainer.max_steps=3", f"output_dir={Path(cfg.output_dir).parent / 'straight'}")
    AgenticPipeline(straight, LocalExecutor()).run()
    other = metrics_of(straight.output_dir)

    def step_3(rows):  # the step's own line (an evaluation may follow it at the same step)
        return {k: v for r in rows if r["step"] == 3 for k, v in r.items() if not k.startswith("time/")}

    assert step_3(rows) == pytest.approx(step_3(other), rel=1e-5, abs=1e-7)


def test_asynchronous_rollout_resumed_plays_on_from_the_step_it_resumed_at(roll_plugins, tiny_config):
    """Not the first training seeds again: the environments' loops start from the resumed step's."""
    from roll_core.pipelines.agentic import TRAINING_SEEDS, AgenticPipeline
    from roll_core.runtime.executor import LocalExecutor

    roll_plugins(("echo", hooks(roll_register_envs=lambda register: register("echo", SeedsSeen))))
    common = ["pipeline=agentic", "agentic.env=echo", "agentic.rollout=async", "warmup.steps=0",
              "agentic.groups_per_step=2", "agentic.group_size=2", "agentic.validation_episodes=0",
              "rollout.max_new_tokens=2", "trainer.save_every=2"]
    AgenticPipeline(tiny_config(*common, "trainer.max_steps=2"), LocalExecutor()).run()
    SeedsSeen.seeds.clear()
    AgenticPipeline(tiny_config(*common, "trainer.max_steps=3"), LocalExecutor()).run()
    assert min(SeedsSeen.seeds) == TRAINING_SEEDS + 2 * 2  # resumed after step 2, two groups a step


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

    roll_plugins(("flaky", hooks(roll_register_envs=lambda register: register("flaky", Flaky))))
    cfg = tiny_config("pipeline=agentic", "agentic.env=flaky", "warmup.steps=0", f"agentic.rollout={rollout}",
                      "agentic.step_timeout_s=0.5", "roles.env.num_workers=2", "trainer.max_steps=3",
                      "agentic.groups_per_step=4", "agentic.group_size=2", "agentic.validation_episodes=0",
                      "rollout.max_new_tokens=2")
    t0 = time.perf_counter()
    summary = AgenticPipeline(cfg, LocalExecutor()).run()
    assert summary["steps"] == 3
    rows = metrics_of(cfg.output_dir)
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
    rows = metrics_of(cfg.output_dir)
    assert rows[0]["warmup/loss"] > 0 and "eval/success_rate" in rows[0]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 2 and all(r["episode/failed"] == 0 and "train/pg_loss" in r for r in steps)


def test_a_warm_up_needs_an_environment_with_an_expert(roll_plugins, tiny_config):
    from roll_core.errors import ConfigError
    from roll_core.pipelines.agentic import AgenticPipeline
    from roll_core.runtime.executor import LocalExecutor

    roll_plugins(("echo", hooks(roll_register_envs=lambda register: register("echo", Echo))))
    cfg = tiny_config("pipeline=agentic", "agentic.env=echo", "warmup.steps=3")
    with pytest.raises(ConfigError, match="imitates the environment's expert, and 'echo' has none"):
        AgenticPipeline(cfg, LocalExecutor()).run()


class EchoWithExpert(Echo):
    def expert_action(self):
        return self.letter


class SeedsSeen(EchoWithExpert):
    """Records the seed of every episode it starts (the env workers of the local executor share this
    process)."""

    seeds: list = []

    def reset(self, seed=None):
        SeedsSeen.seeds.append(seed)
        return super().reset(seed)


def test_a_noisy_teacher_needs_actions_to_draw_from(roll_plugins, tiny_config):
    from roll_core.errors import ConfigError
    from roll_core.pipelines.agentic import AgenticPipeline
    from roll_core.runtime.executor import LocalExecutor

    roll_plugins(("echo", hooks(
        roll_register_envs=lambda register: register("echo", EchoWithExpert))))
    cfg = tiny_config("pipeline=agentic", "agentic.env=echo", "warmup.steps=3", "agentic.teacher_noise=0.2")
    with pytest.raises(ConfigError, match="'echo' lists none; set agentic.teacher_noise=0"):
        AgenticPipeline(cfg, LocalExecutor()).run()


@pytest.mark.parametrize("rollout", ["sync", "async"])
def test_several_environments_train_together_with_metrics_per_environment(roll_plugins, tiny_config, rollout):
    from roll_core.pipelines.agentic import AgenticPipeline
    from roll_core.runtime.executor import LocalExecutor

    roll_plugins(("two", hooks(roll_register_envs=lambda register: [register("echo", Echo), register("flaky", Flaky)])))
    envs = ("[{env: echo, groups_per_step: 2, validation_episodes: 5}, "
            "{env: flaky, name: shaky, groups_per_step: 4, instruction: 'go '}]")
    cfg = tiny_config("pipeline=agentic", f"agentic.envs={envs}", "warmup.steps=0", f"agentic.rollout={rollout}",
                      "agentic.step_timeout_s=0.5", "trainer.max_steps=3", "trainer.eval_every=3",
                      "agentic.group_size=2", "agentic.validation_episodes=0", "rollout.max_new_tokens=2")
    summary = AgenticPipeline(cfg, LocalExecutor()).run()
    assert summary["steps"] == 3
    rows = metrics_of(cfg.output_dir)
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


def _episode(env, group, rewards, success=False, truncated=False, failed=False, hung=False):
    from roll_core.agentic.samples import Episode, Turn

    turns = [Turn([1], [2], [0.0], reward=r) for r in rewards]
    info = {"success": success, **({"hung": True} if hung else {})}
    return Episode(turns, group, truncated=truncated, failed=failed, info=info, env=env)


def test_episode_metrics_over_all_episodes_and_per_environment_when_several_played():
    from roll_core.pipelines.agentic import episode_metrics

    episodes = [_episode("a", 0, [0.0, 1.0], success=True), _episode("a", 0, [0.5], truncated=True, failed=True),
                _episode("b", 1, [], failed=True, hung=True), _episode("b", 1, [2.0, 0.0, 0.0], success=True)]
    assert episode_metrics(episodes, "ep") == {
        "ep/success_rate": 0.5, "ep/return_mean": 3.5 / 4, "ep/turns_mean": 6 / 4, "ep/truncated": 0.25,
        "ep/failed": 2.0, "ep/hung": 1.0,
        "ep/a/success_rate": 0.5, "ep/a/return_mean": 0.75, "ep/a/turns_mean": 1.5, "ep/a/truncated": 0.5,
        "ep/a/failed": 1.0, "ep/a/hung": 0.0,
        "ep/b/success_rate": 0.5, "ep/b/return_mean": 1.0, "ep/b/turns_mean": 1.5, "ep/b/truncated": 0.0,
        "ep/b/failed": 1.0, "ep/b/hung": 1.0}
    assert set(episode_metrics(episodes[:2], "eval")) == {f"eval/{k}" for k in (
        "success_rate", "return_mean", "turns_mean", "truncated", "failed", "hung")}  # one environment: no split
    assert set(episode_metrics([], "eval").values()) == {0.0}


def test_a_lanes_episodes_are_dealt_into_rounds_of_its_slots_and_lanes_play_their_rounds_together(monkeypatch):
    from roll_core.pipelines import agentic

    lane = agentic.EnvLane(spec=type("Spec", (), {"label": "maze"})(), env_cls=Env, rules="rules", per_worker=2)
    rounds = agentic.lane_rounds(lane, ["s0", "s1"], [10, 11, 12, 13, 14], [0, 0, 1, 1, 2])
    assert [[(j.env, j.seed, j.group, j.rules, j.label) for j in jobs] for jobs in rounds] == [
        [("s0", 10, 0, "rules", "maze"), ("s1", 11, 0, "rules", "maze")],
        [("s0", 12, 1, "rules", "maze"), ("s1", 13, 1, "rules", "maze")], [("s0", 14, 2, "rules", "maze")]]

    played = []

    def play_jobs(jobs, policy, concurrent_steps):
        played.append(([j.seed for j in jobs], policy, concurrent_steps))
        return [f"episode {j.seed}" for j in jobs]

    monkeypatch.setattr(agentic, "play_jobs", play_jobs)
    other = agentic.lane_rounds(lane, ["t0"], [20], [0])
    assert agentic.play_rounds([rounds, other], "policy", True) == [f"episode {s}" for s in (10, 11, 20, 12, 13, 14)]
    assert played == [([10, 11, 20], "policy", True), ([12, 13], "policy", True), ([14], "policy", True)]
    assert agentic.training_seed(8, 3) == 1_000_011  # past validation's seeds 0, 1, ...


def test_each_synchronous_step_plays_the_next_fresh_seeds_group_by_group(monkeypatch):
    from types import SimpleNamespace

    from roll_core.pipelines import agentic

    played = []
    monkeypatch.setattr(agentic, "play_rounds", lambda rounds, policy, concurrent_steps: played.append(
        [[(j.seed, j.group) for j in jobs] for lane in rounds for jobs in lane]))
    lane = agentic.EnvLane(spec=SimpleNamespace(label="maze", groups_per_step=2), env_cls=Env, rules=None,
                           per_worker=4, slots=["s0", "s1", "s2", "s3"])
    pipeline = SimpleNamespace(loops=None, lanes=[lane], config=SimpleNamespace(
        agentic=SimpleNamespace(group_size=2), rollout=SimpleNamespace(temperature=1.0)),
                               roles=SimpleNamespace(use=lambda *roles: None), _policy=lambda temperature: None)
    for step in (1, 2):
        agentic.AgenticPipeline._rollout(pipeline, step)
    first = 1_000_000
    assert played == [[[(first, 0), (first, 0), (first + 1, 1), (first + 1, 1)]],
                      [[(first + 2, 0), (first + 2, 0), (first + 3, 1), (first + 3, 1)]]]


def test_the_environments_are_named_one_way_only_and_their_labels_differ(tiny_config):
    from roll_core.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="either agentic.env"):
        tiny_config("pipeline=agentic", "agentic.env=echo", "agentic.envs=[{env: flaky}]")
    with pytest.raises((ConfigError, ValueError), match="repeat"):
        tiny_config("pipeline=agentic", "agentic.envs=[{env: echo}, {env: echo}]")
    cfg = tiny_config("pipeline=agentic", "agentic.envs=[{env: echo}, {env: echo, name: echo2, max_turns: 3}]")
    first, second = cfg.agentic.environments()
    assert (first.label, first.max_turns, second.label, second.max_turns) == ("echo", 10, "echo2", 3)


def test_an_environment_that_refuses_its_options_stops_the_run_with_a_config_error(roll_plugins, tiny_config):
    """The pipeline builds one of each environment as it prepares (:func:`roll_core.envs.build_env`):
    a value its constructor refuses is a config error naming the key, not a traceback from an env worker."""
    from roll_core.errors import ConfigError
    from roll_core.pipelines.agentic import AgenticPipeline
    from roll_core.runtime.executor import LocalExecutor

    class Sized(EchoWithExpert):
        def __init__(self, size: int = 4):
            if size < 2:
                raise ValueError(f"size must be at least 2, got {size}")

    roll_plugins(("sized", hooks(roll_register_envs=lambda register: register("sized", Sized))))
    cfg = tiny_config("pipeline=agentic", "agentic.envs=[{env: sized, name: small, env_options: {size: 1}}]")
    with pytest.raises(ConfigError) as err:
        AgenticPipeline(cfg, LocalExecutor()).run()
    assert str(err.value) == ("key 'agentic.envs[0].env_options' for environment 'sized': size must be at least "
                              "2, got 1")
