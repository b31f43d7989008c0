"""``agentic``: multi-turn RL on a registered environment (the ``agentic`` config section).

Each step plays ``groups_per_step`` seeds x ``group_size`` episodes against actor_infer, turn by
turn (:mod:`roll_core.agentic.episodes`), lays them out as rows (:mod:`roll_core.agentic.samples`),
and trains actor_train with the multi-turn estimator the config names (``agentic_reinforce``:
trajectory-wise; ``gigpo``: step-wise, grouping turns by ``state_hash``), through the same shaping,
updater and weight sync as ``rlvr``. With ``warmup.steps``, actor_train first imitates a careless
teacher's episodes (:class:`TeacherEpisodes`), like ``rlvr``'s warm-up on the careless teacher's
demonstrations. Validation plays the held-out seeds greedily and reports the success rate.

Environments run on env workers (:mod:`roll_core.agentic.env_workers`: ``agentic.env_workers``
Ray actors, ``envs_per_worker`` environments each, every call bounded by ``step_timeout_s``). With
``agentic.rollout: sync`` each turn of a step waits for every environment; with ``async`` each
environment plays its own loop (:mod:`roll_core.agentic.async_rollout`), across steps up to
``rollout.async_generation_ratio`` ahead of training. Validation plays in the driver, through an
env worker object of its own (the same timeouts). Run::

    roll run examples/agentic_frozen_lake.yaml                                  # trajectory-wise
    roll run examples/agentic_frozen_lake.yaml algorithm.advantage_estimator=gigpo  # step-wise
"""

from __future__ import annotations

from pathlib import Path

import math
import time

from roll_core.agentic.async_rollout import EnvLoops, RequestBatcher
from roll_core.agentic.env_workers import EnvWorker, RemoteEnv
from roll_core.agentic.episodes import Policy, Rules, TurnFormat, engine_policy, play, teacher_policy
from roll_core.agentic.samples import Episode, episode_batch
from roll_core.algorithms.objective import ActorObjective
from roll_core.algorithms.shaping import RewardShaper
from roll_core.data import Batch
from roll_core.envs import Env
from roll_core.errors import ConfigError
from roll_core.pipelines.runtime import (SEED_OFFSETS, TrainingLoop, log_probs, save_tokenizer_beside,
                                         start_update)
from roll_core.pipelines.sft import WarmStart
from roll_core.runtime import weight_sync
from roll_core.runtime.executor import LocalExecutor
from roll_core.runtime.placement import colocated
from roll_core.training import UpdateSpec

TRAINING_SEEDS = 1_000_000  # training seeds start here; validation uses 0, 1, ...
WARMUP_SEEDS = 2_000_000  # the warm-up teacher's seeds start here


def play_new(env_cls, config, seeds: list[int], groups: list[int], policy: Policy, tokenizer,
             turn_format: TurnFormat) -> list[Episode]:
    """One episode per seed on a fresh environment each (``agentic.env_options``), closed afterwards."""
    a = config.agentic
    envs = [env_cls(**a.env_options) for _ in seeds]
    try:
        return play(envs, seeds, groups, policy, tokenizer, turn_format=turn_format, max_turns=a.max_turns,
                    max_length=a.max_length)
    finally:
        for env in envs:
            env.close()


class TeacherEpisodes:
    """The agentic warm-up's batches: each call plays ``warmup.batch_size`` episodes of the careless
    teacher (:func:`~roll_core.agentic.episodes.teacher_policy`) on the next fresh seeds, laid out
    as training rows whose loss covers the actions only."""

    def __init__(self, env_cls, config, tokenizer, turn_format: TurnFormat):
        self.env_cls, self.config, self.tokenizer, self.turn_format = env_cls, config, tokenizer, turn_format
        self.policy = teacher_policy(tokenizer, noise=config.agentic.teacher_noise,
                                     seed=config.seed + SEED_OFFSETS["warmup_data"])
        self.next_seed = WARMUP_SEEDS

    def __call__(self) -> Batch:
        n = self.config.warmup.batch_size
        seeds = list(range(self.next_seed, self.next_seed + n))
        self.next_seed += n
        episodes = play_new(self.env_cls, self.config, seeds, list(range(n)), self.policy, self.tokenizer,
                            self.turn_format)
        batch = episode_batch([e for e in episodes if e.turns], self.tokenizer.pad_token_id,
                              self.config.agentic.max_length)
        batch.update(loss_mask=batch["action_mask"].float())
        return batch


def episode_metrics(episodes: list[Episode], prefix: str) -> dict[str, float]:
    """Success rate, return, length in turns, the share of truncated episodes, and counts of failed
    ones (the environment raised or hung) and of hung ones."""
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


class AgenticPipeline(WarmStart, TrainingLoop):
    step_label = "agentic step"

    def prepare(self) -> None:
        cfg, a = self.config, self.config.agentic
        self.model, self.tokenizer = self.policy()
        self.env_cls = self.plugins.envs.get(a.env)
        try:
            probe = self.env_cls(**a.env_options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"key 'agentic.env_options' for environment '{a.env}': {exc}") from None
        probe.close()
        if cfg.warmup.steps and self.env_cls.expert_action is Env.expert_action:
            raise ConfigError(f"warmup.steps={cfg.warmup.steps} imitates the environment's expert, and "
                              f"'{a.env}' has none (no expert_action()); set warmup.steps=0")
        if cfg.warmup.steps and a.teacher_noise > 0 and not probe.actions:
            raise ConfigError(f"agentic.teacher_noise={a.teacher_noise} makes the warm-up's teacher draw random "
                              f"actions from the environment's 'actions', and '{a.env}' lists none; set "
                              f"agentic.teacher_noise=0")
        if a.rollout == "async" and "actor_train" in colocated(cfg).get("actor_infer", set()):
            raise ConfigError("agentic.rollout: async generates while actor_train trains, so actor_infer needs "
                              "devices of its own; it shares them with actor_train here (roles.*.devices)")
        self.turn_format = TurnFormat(a.instruction, a.observation_prefix, a.observation_suffix)
        self.rules = Rules(self.tokenizer, self.turn_format, a.max_turns, a.max_length)
        in_flight = a.groups_per_step * a.group_size
        if a.rollout == "async":
            in_flight = math.ceil((1 + cfg.rollout.async_generation_ratio) * in_flight)
        self.per_worker = a.envs_per_worker or math.ceil(in_flight / a.env_workers)
        self.before: dict[str, float] = {}
        self.loops: EnvLoops | None = None

    def build(self) -> None:
        cfg, roles, a = self.config, self.config.roles, self.config.agentic
        self._stop_loops()  # a restart after a lost worker: the last attempt's loops play on dead workers
        self.actor = self.roles.model_role("actor_train", "train", self.model, roles.actor_train)
        self.infer = self.roles.model_role("actor_infer", "infer", self.model, roles.actor_infer)
        self.weights = weight_sync.connect(cfg, self.executor, self.actor, self.infer, False, self.plugins)
        self.reference = None  # spawned on the model RL starts from (after the warm-up): begin(), restore()
        self.shaper = RewardShaper(cfg.algorithm, self.plugins)
        self.update = (ActorObjective.from_config(cfg.algorithm, cfg.rollout, self.plugins),
                       UpdateSpec.from_config(cfg.algorithm, roles.actor_train))
        args = (a.env, a.env_options, self.per_worker, a.step_timeout_s)
        envs = self.executor.spawn("env", EnvWorker, [args] * a.env_workers, None, concurrency=self.per_worker + 1,
                                   cpus=a.env_worker_cpus)
        self.slots = env_slots(self.executor, envs, self.env_cls, self.per_worker)
        n = max(a.validation_episodes, 1)  # validation: the driver's own slots, played greedily in lockstep
        self.eval_slots = env_slots(LocalExecutor(), LocalExecutor().spawn(
            "env_eval", EnvWorker, [(a.env, a.env_options, n, a.step_timeout_s)]), self.env_cls, n)

    def _policy(self, temperature: float) -> Policy:
        def generate(batch: Batch, **sampling) -> Batch:
            return Batch.concat(self.executor.get(self.infer.per_replica("generate", batch, **sampling)))

        r = self.config.rollout
        return engine_policy(generate, self.tokenizer.pad_token_id, max_new_tokens=r.max_new_tokens,
                             temperature=temperature, top_p=r.top_p if temperature > 0 else 1.0)

    def _play(self, slots: list[RemoteEnv], seeds: list[int], groups: list[int], temperature: float,
              concurrent_steps: bool) -> list[Episode]:
        """Lockstep episodes on ``slots``, as many at a time as there are slots."""
        policy, episodes, n = self._policy(temperature), [], len(slots)
        for i in range(0, len(seeds), n):
            episodes += play(slots, seeds[i:i + n], groups[i:i + n], policy, self.tokenizer,
                             turn_format=self.turn_format, max_turns=self.rules.max_turns,
                             max_length=self.rules.max_length, concurrent_steps=concurrent_steps)
        return episodes

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
        if self.config.roles.reference is not None:
            self.reference = self.roles.reference(self.actor, self.start_model())

    def begin(self) -> dict[str, float]:
        self.start_step, first = 0, {}
        if self.config.warmup.steps:
            first = self.warmup(TeacherEpisodes(self.env_cls, self.config, self.tokenizer, self.turn_format))
        self._spawn_reference()
        self.before = self.evaluate()
        if self.before:
            print(f"held-out success rate before RL (greedy): {self.before['eval/success_rate']:.1%}", flush=True)
        return {**first, **self.before}

    def before_steps(self) -> None:
        cfg, a = self.config, self.config.agentic
        if a.rollout == "async":
            first_group = self.start_step * a.groups_per_step  # resumed runs play new seeds
            self.roles.use("actor_infer")
            self.loops = EnvLoops(self.slots, RequestBatcher(self._policy(cfg.rollout.temperature)), self.rules,
                                  groups_per_step=a.groups_per_step, group_size=a.group_size,
                                  seed_of=lambda g: TRAINING_SEEDS + first_group + g,
                                  async_generation_ratio=cfg.rollout.async_generation_ratio)
            self.loops.start()

    def after_steps(self) -> None:
        self._stop_loops()

    def _stop_loops(self) -> None:
        if self.loops is not None:
            self.loops.stop()
            self.loops.ask.close()
            self.loops = None

    def _rollout(self, step: int) -> tuple[list[Episode], dict[str, float]]:
        a = self.config.agentic
        if self.loops is not None:
            return self.loops.take()
        first = TRAINING_SEEDS + (step - 1) * a.groups_per_step
        seeds = [first + g for g in range(a.groups_per_step) for _ in range(a.group_size)]
        self.roles.use("actor_infer")
        return self._play(self.slots, seeds, [s - TRAINING_SEEDS for s in seeds], self.config.rollout.temperature,
                          concurrent_steps=True), {}

    def step(self, step: int) -> dict[str, float]:
        a, temperature = self.config.agentic, self.config.rollout.temperature
        t0 = time.perf_counter()
        episodes, metrics = self._rollout(step)
        t_rollout = time.perf_counter() - t0
        metrics.update(episode_metrics(episodes, "episode"))
        batch = episode_batch([e for e in episodes if e.turns], self.tokenizer.pad_token_id, a.max_length)
        if self.reference is not None:
            self.roles.use(self.reference.resident_role)
            batch.update(ref_log_probs=log_probs(self.executor, self.reference, batch, temperature)[0])
        self.roles.use("actor_train")
        batch.update(old_log_probs=log_probs(self.executor, self.actor, batch, temperature)[0])
        metrics.update(self.shaper.shape(batch))
        metrics.update(self.executor.get(start_update(self.actor, batch, *self.update))[0])
        t1 = time.perf_counter()
        self.push_weights(policy_update=True)
        t2 = time.perf_counter()
        metrics.update({"time/rollout_s": t_rollout, "time/train_s": t1 - t0 - t_rollout,
                        "time/weight_sync_s": t2 - t1, "time/step_s": t2 - t0})
        return metrics

    def evaluate(self) -> dict[str, float]:
        """The success rate on the held-out seeds, greedy (rollout generation paused meanwhile)."""
        n = self.config.agentic.validation_episodes
        if not n:
            return {}
        self.roles.use("actor_infer")
        self.phase = "validation"
        seeds = list(range(n))
        if self.loops is None:
            return episode_metrics(self._play(self.eval_slots, seeds, seeds, 0.0, False), "eval")
        with self.loops.ask.paused():
            return episode_metrics(self._play(self.eval_slots, seeds, seeds, 0.0, False), "eval")

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
