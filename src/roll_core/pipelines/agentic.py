"""``agentic``: multi-turn RL on registered environments (the ``agentic`` config section).

Each step plays ``groups_per_step`` seeds x ``group_size`` episodes of each environment of the run
(``agentic.env``, or several in ``agentic.envs``: an :class:`EnvLane` each, with its own env
workers, turn format and metrics ``episode/LABEL/...``) against actor_infer, turn by
turn (:mod:`roll_core.agentic.episodes`), lays them out as rows (:mod:`roll_core.agentic.samples`),
and trains actor_train with the multi-turn estimator the config names (``agentic_reinforce``:
trajectory-wise; ``gigpo``: step-wise, grouping turns by ``state_hash``), through the same shaping,
updater and weight sync as ``rlvr``. With ``warmup.steps``, actor_train first imitates a careless
teacher's episodes (:class:`TeacherEpisodes`), like ``rlvr``'s warm-up on the careless teacher's
demonstrations. Validation plays the held-out seeds greedily and reports the success rate.

Environments run on env workers (:mod:`roll_core.agentic.env_workers`), an env role's
(``roles.env`` unless ``agentic.role`` or an entry's ``role`` names another): ``num_workers`` Ray
actors per environment, ``envs_per_worker`` environments each, every call bounded by
``agentic.step_timeout_s``. With
``agentic.rollout: sync`` each turn of a step waits for every environment; with ``async`` each
environment plays its own loop (:mod:`roll_core.agentic.async_rollout`), across steps up to
``rollout.async_generation_ratio`` ahead of training. Validation plays in the driver, through an
env worker object of its own (the same timeouts). Run::

    roll run examples/agentic_frozen_lake.yaml                                  # trajectory-wise
    roll run examples/agentic_frozen_lake.yaml algorithm.advantage_estimator=gigpo  # step-wise
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from itertools import zip_longest
from pathlib import Path

import math
import time

from roll_core.agentic.async_rollout import EnvLoops, Lane, RequestBatcher
from roll_core.agentic.env_workers import EnvWorker, RemoteEnv
from roll_core.agentic.episodes import Job, Policy, Rules, TurnFormat, engine_policy, play_jobs, teacher_policy
from roll_core.agentic.samples import Episode, episode_batch
from roll_core.algorithms.shaping import RewardShaper
from roll_core.data import Batch
from roll_core.envs import Env, build_env
from roll_core.config.loader import group_baseline_problems, image_role_problems
from roll_core.config.schema import EnvRoleConfig, EnvSettings
from roll_core.errors import ConfigError
from roll_core.multimodal import processor_for
from roll_core.pipelines.runtime import (SEED_OFFSETS, PolicyGradientLoop, log_probs, save_tokenizer_beside,
                                         start_update)
from roll_core.pipelines.sft import WarmStart
from roll_core.runtime import weight_sync
from roll_core.training import policy_gradient_update

TRAINING_SEEDS = 1_000_000  # training seeds start here; validation uses 0, 1, ...
WARMUP_SEEDS = 2_000_000  # the warm-up teacher's seeds start here


def training_seed(first_group: int, group: int) -> int:
    """The seed of a step's group ``group`` whose first group is ``first_group`` (per environment)."""
    return TRAINING_SEEDS + first_group + group


@dataclass
class EnvLane:
    """One environment of the run (``agentic.environments()``): its settings, class and
    rules, and once built its training slots (on env workers) and validation slots (in the driver)."""

    spec: EnvSettings
    env_cls: type[Env]
    rules: Rules
    per_worker: int  # environment slots per env worker
    slots: list[RemoteEnv] = field(default_factory=list)
    eval_slots: list[RemoteEnv] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.spec.label


def lane_rounds(lane: EnvLane, slots: list, seeds: list[int], groups: list[int]) -> list[list[Job]]:
    """The lane's episodes as rounds of jobs, one round per ``len(slots)`` episodes."""
    n = len(slots)
    return [[Job(env, seed, group, lane.rules, lane.label)
             for env, seed, group in zip(slots, seeds[i:i + n], groups[i:i + n])] for i in range(0, len(seeds), n)]


def play_rounds(rounds_per_lane: list[list[list[Job]]], policy: Policy, concurrent_steps: bool) -> list[Episode]:
    """Round k of every lane played together in lockstep, one round after the other."""
    episodes: list[Episode] = []
    for rounds in zip_longest(*rounds_per_lane, fillvalue=[]):
        episodes += play_jobs([job for jobs in rounds for job in jobs], policy, concurrent_steps=concurrent_steps)
    return episodes


def distinct_groups(episodes: list[Episode]) -> list[Episode]:
    """Renumber the episodes' groups 0, 1, ... by (environment, group) in order of first appearance:
    each environment numbers its own groups, and two environments' groups must never share a baseline."""
    ids: dict[tuple[str, int], int] = {}
    for e in episodes:
        e.group = ids.setdefault((e.env, e.group), len(ids))
    return episodes


class TeacherEpisodes:
    """The agentic warm-up's batches: each call plays ``warmup.batch_size`` episodes of the careless
    teacher (:func:`~roll_core.agentic.episodes.teacher_policy`), shared out over the run's
    environments, on the next fresh seeds and fresh local environments, laid out as training rows
    whose loss covers the actions only."""

    def __init__(self, lanes: list[EnvLane], config, tokenizer):
        self.lanes, self.config, self.tokenizer = lanes, config, tokenizer
        self.policy = teacher_policy(tokenizer, noise=config.agentic.teacher_noise,
                                     seed=config.seed + SEED_OFFSETS["warmup_data"])
        self.next_seed = WARMUP_SEEDS

    def __call__(self) -> Batch:
        n = self.config.warmup.batch_size
        jobs = []
        for i in range(n):
            lane = self.lanes[i % len(self.lanes)]
            env = lane.env_cls(**lane.spec.env_options)
            jobs.append(Job(env, self.next_seed + i, i, lane.rules, lane.label))
        self.next_seed += n
        try:
            episodes = play_jobs(jobs, self.policy)
        finally:
            for job in jobs:
                job.env.close()
        batch = episode_batch([e for e in episodes if e.turns], self.tokenizer.pad_token_id,
                              self.config.agentic.max_length)
        batch.update(loss_mask=batch["action_mask"].float())
        return batch


def episode_metrics(episodes: list[Episode], prefix: str) -> dict[str, float]:
    """Success rate, return, length in turns, the share of truncated episodes, and counts of failed
    ones (the environment raised or hung) and of hung ones: over all episodes as ``prefix/...``, and
    when several environments played, per environment as ``prefix/LABEL/...`` too."""
    metrics = _episode_metrics(episodes, prefix)
    labels = sorted({e.env for e in episodes})
    if len(labels) > 1:
        for label in labels:
            metrics.update(_episode_metrics([e for e in episodes if e.env == label], f"{prefix}/{label}"))
    return metrics


def _episode_metrics(episodes: list[Episode], prefix: str) -> dict[str, float]:
    n = max(len(episodes), 1)
    return {f"{prefix}/success_rate": sum(bool(e.info.get("success")) for e in episodes) / n,
            f"{prefix}/return_mean": sum(e.reward for e in episodes) / n,
            f"{prefix}/turns_mean": sum(len(e.turns) for e in episodes) / n,
            f"{prefix}/truncated": sum(e.truncated for e in episodes) / n,
            f"{prefix}/failed": float(sum(e.failed for e in episodes)),
            f"{prefix}/hung": float(sum(bool(e.info.get("hung")) for e in episodes))}


def env_slots(executor, group, env_cls, per_worker: int) -> list[RemoteEnv]:
    """Every environment slot of an env worker group, worker by worker."""
    return [RemoteEnv(executor, handle, slot, env_cls) for handle in group.handles for slot in range(per_worker)]


class AgenticPipeline(WarmStart, PolicyGradientLoop):
    step_label = "agentic step"
    config_sections = frozenset({"warmup", "agentic"})
    overlap_setting = "agentic.rollout: async"
    @classmethod
    def config_problems(cls, cfg, plugins) -> list[str]:
        # greedy sampling may still learn: an episode's environment can tell its samples apart
        roles = [p for e in cfg.agentic.environments() for p in cfg.named_role_problems(f"{e.key}.role", e.role, "env")]
        return (super().config_problems(cfg, plugins) + roles
                + group_baseline_problems(cfg, plugins, "agentic.group_size", cfg.agentic.group_size, greedy=False))

    @classmethod
    def generates_while_training(cls, cfg, plugins) -> str | None:
        """``agentic.rollout: async`` plays episodes while the policy trains (no rollout scheduler)."""
        return "agentic.rollout: async generates while the policy trains" if cfg.agentic.rollout == "async" else None

    @classmethod
    def environments(cls, cfg) -> list[EnvSettings]:
        return cfg.agentic.environments()

    @classmethod
    def describe_task(cls, cfg) -> str:
        return "environments " + ", ".join(f"{e.label} ({e.env})" for e in cls.environments(cfg))

    def prepare(self) -> None:
        a = self.config.agentic
        self.model, self.tokenizer = self.policy()
        self.lanes = [self._lane(spec) for spec in a.environments()]
        self.before: dict[str, float] = {}
        self.loops: EnvLoops | None = None

    def _lane(self, spec: EnvSettings) -> EnvLane:
        """One environment's lane, its settings checked before any worker starts."""
        cfg, a = self.config, self.config.agentic
        env_cls = self.plugins.envs.get(spec.env)
        probe = build_env(env_cls, spec.env, spec.env_options, f"key '{spec.key}.env_options'")
        probe.close()
        if cfg.warmup.steps and env_cls.expert_action is Env.expert_action:
            raise ConfigError(f"warmup.steps={cfg.warmup.steps} imitates the environment's expert, and "
                              f"'{spec.env}' has none (no expert_action()); set warmup.steps=0")
        if cfg.warmup.steps and a.teacher_noise > 0 and not probe.actions:
            raise ConfigError(f"agentic.teacher_noise={a.teacher_noise} makes the warm-up's teacher draw random "
                              f"actions from the environment's 'actions', and '{spec.env}' lists none; set "
                              f"agentic.teacher_noise=0")
        if probe.image_observations:
            self._check_images(spec)
        turn_format = TurnFormat(spec.instruction, a.observation_prefix, a.observation_suffix)
        in_flight = spec.groups_per_step * a.group_size
        if a.rollout == "async":
            in_flight = math.ceil((1 + cfg.rollout.async_generation_ratio) * in_flight)
        role = self._env_role(spec)
        return EnvLane(spec, env_cls, Rules(self.tokenizer, turn_format, spec.max_turns, a.max_length),
                       role.envs_per_worker or math.ceil(in_flight / role.num_workers))

    def _check_images(self, spec: EnvSettings) -> None:
        """An environment that shows images needs an image-text model and strategies that read images."""
        problems = image_role_problems(self.config, self.plugins, f"environment '{spec.env}' shows them")
        if problems:
            raise ConfigError("; ".join(problems))
        processor_for(self.tokenizer.name_or_path)  # a model without an image processor cannot see them

    def _env_role(self, spec: EnvSettings) -> EnvRoleConfig:
        role = self.config.role(spec.role, "env")  # checked with the config: present, of kind env
        assert isinstance(role, EnvRoleConfig)
        return role

    def build(self) -> None:
        cfg, a = self.config, self.config.agentic
        self._stop_loops()  # a restart after a lost worker: the last attempt's loops play on dead workers
        self.actor, self.infer = self.roles.model_roles(("actor_train", self.model), ("actor_infer", self.model))
        self.weights = weight_sync.connect(cfg, self.executor, self.actor, self.infer, False, self.plugins)
        self.reference = None  # spawned on the model RL starts from (after the warm-up): begin(), restore()
        self.shaper = RewardShaper(cfg.algorithm, self.plugins)
        self.update = policy_gradient_update(cfg, self.plugins)
        for lane in self.lanes:
            spec, per_worker = lane.spec, lane.per_worker
            args = (spec.env, spec.env_options, per_worker, a.step_timeout_s)
            role = self._env_role(spec)
            workers = self.executor.spawn(f"env_{spec.label}", EnvWorker, [args] * role.num_workers, None,
                                          concurrency=per_worker + 1, cpus=role.cpus)
            lane.slots = env_slots(self.executor, workers, lane.env_cls, per_worker)
            # validation: the driver's own slots, played greedily in lockstep
            n = max(spec.validation_episodes, 1)
            driver = self.roles.driver
            lane.eval_slots = env_slots(driver, driver.spawn(f"env_eval_{spec.label}", EnvWorker, [
                (spec.env, spec.env_options, n, a.step_timeout_s)]), lane.env_cls, n)

    def _policy(self, temperature: float) -> Policy:
        def generate(batch: Batch, **sampling) -> Batch:
            return Batch.concat(self.executor.get(self.infer.per_replica("generate", batch, **sampling)))

        return engine_policy(generate, self.tokenizer.pad_token_id, **self.config.rollout.sampling(temperature))

    def push_weights(self, policy_update: bool = False) -> None:
        self.roles.use("actor_train", "actor_infer")
        if self.loops is None:
            self.weights.update(new_version=policy_update, wait=True)
            return
        with self.loops.ask.paused():  # no generation while weights load
            self.weights.update(new_version=policy_update, wait=True)
            if policy_update:
                self.loops.policy_updated()

    def _spawn_reference(self) -> None:
        if self.starts_reference(self.config, self.plugins):
            self.reference = self.roles.reference(self.actor, self.start_model())

    def begin(self) -> dict[str, float]:
        self.start_step, first = 0, {}
        if self.config.warmup.steps:
            first = self.warmup(TeacherEpisodes(self.lanes, self.config, self.tokenizer))
        self._spawn_reference()
        self.before = self.evaluate()
        if self.before:
            print(f"held-out success rate before RL (greedy): {self.before['eval/success_rate']:.1%}", flush=True)
        return {**first, **self.before}

    def before_steps(self) -> None:
        cfg, a = self.config, self.config.agentic
        if a.rollout == "async":
            self.roles.use("actor_infer")
            lanes = [Lane(lane.label, lane.slots, lane.rules, lane.spec.groups_per_step,
                          # resumed runs play new seeds
                          seed_of=partial(training_seed, self.start_step * lane.spec.groups_per_step))
                     for lane in self.lanes]
            self.loops = EnvLoops(lanes, RequestBatcher(self._policy(cfg.rollout.temperature)),
                                  group_size=a.group_size, async_generation_ratio=cfg.rollout.async_generation_ratio)
            self.loops.start()

    def after_steps(self) -> None:
        self._stop_loops()

    def _stop_loops(self) -> None:
        if self.loops is not None:
            self.loops.stop()
            self.loops.ask.close()
            self.loops = None

    def _rollout(self, step: int) -> tuple[list[Episode], dict[str, float]]:
        if self.loops is not None:
            return self.loops.take()
        rounds = []
        for lane in self.lanes:
            n = lane.spec.groups_per_step
            groups = [g for g in range(n) for _ in range(self.config.agentic.group_size)]
            rounds.append(lane_rounds(lane, lane.slots, [training_seed((step - 1) * n, g) for g in groups], groups))
        self.roles.use("actor_infer")
        return play_rounds(rounds, self._policy(self.config.rollout.temperature), concurrent_steps=True), {}

    def step(self, step: int) -> dict[str, float]:
        a, temperature = self.config.agentic, self.config.rollout.temperature
        t0 = time.perf_counter()
        episodes, metrics = self._rollout(step)
        distinct_groups(episodes)
        t_rollout = time.perf_counter() - t0
        metrics.update(episode_metrics(episodes, "episode"))
        batch = episode_batch([e for e in episodes if e.turns], self.tokenizer.pad_token_id, a.max_length)
        if self.reference is not None:
            self.roles.use(self.reference.resident_role)
            batch.update(ref_log_probs=log_probs(self.executor, self.reference, batch, temperature)[0])
        self.roles.use("actor_train")
        batch.update(old_log_probs=log_probs(self.executor, self.actor, batch, temperature)[0])
        metrics.update(self.shaper.shape(batch))
        self.dump_rollouts(step, batch)
        metrics.update(self.executor.get(start_update(self.actor, batch, *self.update))[0])
        t1 = time.perf_counter()
        self.push_weights(policy_update=True)
        t2 = time.perf_counter()
        metrics.update({"time/rollout_s": t_rollout, "time/train_s": t1 - t0 - t_rollout,
                        "time/weight_sync_s": t2 - t1, "time/step_s": t2 - t0})
        return metrics

    def evaluate(self) -> dict[str, float]:
        """The success rate on the held-out seeds, greedy (rollout generation paused meanwhile)."""
        if not any(lane.spec.validation_episodes for lane in self.lanes):
            return {}
        self.roles.use("actor_infer")
        self.phase = "validation"
        rounds = [lane_rounds(lane, lane.eval_slots, list(range(lane.spec.validation_episodes)),
                              list(range(lane.spec.validation_episodes))) for lane in self.lanes]
        with self.loops.ask.paused() if self.loops is not None else nullcontext():
            return episode_metrics(play_rounds(rounds, self._policy(0.0), concurrent_steps=False), "eval")

    def write_checkpoint(self, tmp: Path) -> dict:
        self.roles.use("actor_train")
        self.executor.get(self.actor.call("save_checkpoint", str(tmp / "actor_train")))
        save_tokenizer_beside(self.tokenizer, tmp / "actor_train")
        self.roles.save_rng("actor_infer", tmp / "infer_rng.pt")
        return {"before": self.before, "shaping": self.shaper.state_dict()}

    def restore(self, path: Path, state: dict) -> None:
        self.start_step = int(state["step"])
        self._spawn_reference()
        self.executor.get(self.actor.call("load_checkpoint", str(path / "actor_train")))
        self.roles.load_rng("actor_infer", path / "infer_rng.pt")
        self.before = state["before"]
        self.shaper.load_state_dict(state["shaping"])
        self.executor.get(self.rebase_inference())
        self.push_weights()

    def summary(self, final_step: int, after: dict[str, float]) -> dict:
        summary = {"steps": final_step, "before": self.before, "after": after}
        if self.before and after:
            b, f = self.before["eval/success_rate"], after["eval/success_rate"]
            print(f"held-out success rate (greedy): {b:.1%} -> {f:.1%} ({100 * (f - b):+.1f} pp) after "
                  f"{final_step} agentic steps", flush=True)
        return summary
