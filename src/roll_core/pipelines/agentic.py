"""``agentic``: multi-turn RL on a registered environment (the ``agentic`` config section).

Each step plays ``groups_per_step`` seeds x ``group_size`` episodes against actor_infer, turn by
turn (:mod:`roll_core.agentic.episodes`), lays them out as rows (:mod:`roll_core.agentic.samples`),
and trains actor_train with the multi-turn estimator the config names (``agentic_reinforce``:
trajectory-wise; ``gigpo``: step-wise, grouping turns by ``state_hash``), through the same shaping,
updater and weight sync as ``rlvr``. Validation plays the held-out seeds greedily and reports the
success rate. Environments run in the driver, all episodes of a step advancing one turn per policy
call; env workers and environment-level asynchronous rollout are not built yet. Run::

    roll run pipeline=agentic agentic.env=frozen_lake algorithm.advantage_estimator=gigpo warmup.steps=0
"""

from __future__ import annotations

from pathlib import Path

from roll_core.agentic.episodes import TurnFormat, engine_policy, play
from roll_core.agentic.samples import Episode, episode_batch
from roll_core.algorithms.objective import ActorObjective
from roll_core.algorithms.shaping import RewardShaper
from roll_core.data import Batch
from roll_core.errors import ConfigError
from roll_core.pipelines.runtime import TrainingLoop, log_probs, start_update
from roll_core.runtime import weight_sync
from roll_core.training import UpdateSpec

TRAINING_SEEDS = 1_000_000  # training seeds start here; validation uses 0, 1, ...


def episode_metrics(episodes: list[Episode], prefix: str) -> dict[str, float]:
    """Success rate, return, length in turns, and the shares of truncated and failed episodes."""
    n = max(len(episodes), 1)
    return {f"{prefix}/success_rate": sum(bool(e.info.get("success")) for e in episodes) / n,
            f"{prefix}/return_mean": sum(e.reward for e in episodes) / n,
            f"{prefix}/turns_mean": sum(len(e.turns) for e in episodes) / n,
            f"{prefix}/truncated": sum(e.truncated for e in episodes) / n,
            f"{prefix}/failed": float(sum(e.failed for e in episodes))}


class AgenticPipeline(TrainingLoop):
    step_label = "agentic step"

    def prepare(self) -> None:
        cfg = self.config
        self.model, self.tokenizer = self.policy()
        self.env_cls = self.plugins.envs.get(cfg.agentic.env)
        try:
            self.env_cls(**cfg.agentic.env_options).close()
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"key 'agentic.env_options' for environment '{cfg.agentic.env}': {exc}") from None
        a = cfg.agentic
        self.turn_format = TurnFormat(a.instruction, a.observation_prefix, a.observation_suffix)
        self.before: dict[str, float] = {}

    def build(self) -> None:
        cfg, roles = self.config, self.config.roles
        self.actor = self.roles.model_role("actor_train", "train", self.model, roles.actor_train)
        self.infer = self.roles.model_role("actor_infer", "infer", self.model, roles.actor_infer)
        self.weights = weight_sync.connect(cfg, self.executor, self.actor, self.infer, False, self.plugins)
        self.reference = self.roles.reference(self.actor, self.model) if roles.reference is not None else None
        self.shaper = RewardShaper(cfg.algorithm, self.plugins)
        self.update = (ActorObjective.from_config(cfg.algorithm, cfg.rollout, self.plugins),
                       UpdateSpec.from_config(cfg.algorithm, roles.actor_train))

    def _play(self, seeds: list[int], groups: list[int], temperature: float) -> list[Episode]:
        def generate(batch: Batch, **sampling) -> Batch:
            return Batch.concat(self.executor.get(self.infer.per_replica("generate", batch, **sampling)))

        a, r = self.config.agentic, self.config.rollout
        policy = engine_policy(generate, self.tokenizer.pad_token_id, max_new_tokens=r.max_new_tokens,
                               temperature=temperature, top_p=r.top_p if temperature > 0 else 1.0)
        envs = [self.env_cls(**a.env_options) for _ in seeds]
        try:
            return play(envs, seeds, groups, policy, self.tokenizer, turn_format=self.turn_format,
                        max_turns=a.max_turns, max_length=a.max_length)
        finally:
            for env in envs:
                env.close()

    def begin(self) -> dict[str, float]:
        self.before = self.evaluate()
        return self.before

    def step(self, step: int) -> dict[str, float]:
        a, temperature = self.config.agentic, self.config.rollout.temperature
        first = TRAINING_SEEDS + (step - 1) * a.groups_per_step
        seeds = [first + g for g in range(a.groups_per_step) for _ in range(a.group_size)]
        self.roles.use("actor_infer")
        episodes = self._play(seeds, [s - TRAINING_SEEDS for s in seeds], temperature)
        metrics = episode_metrics(episodes, "episode")
        batch = episode_batch([e for e in episodes if e.turns], self.tokenizer.pad_token_id, a.max_length)
        if self.reference is not None:
            self.roles.use(self.reference.resident_role)
            batch.update(ref_log_probs=log_probs(self.executor, self.reference, batch, temperature)[0])
        self.roles.use("actor_train")
        batch.update(old_log_probs=log_probs(self.executor, self.actor, batch, temperature)[0])
        metrics.update(self.shaper.shape(batch))
        metrics.update(self.executor.get(start_update(self.actor, batch, *self.update))[0])
        self.roles.use("actor_train", "actor_infer")
        self.weights.update(new_version=True, wait=True)
        return metrics

    def evaluate(self) -> dict[str, float]:
        """The success rate on the held-out seeds, greedy."""
        n = self.config.agentic.validation_episodes
        if not n:
            return {}
        self.roles.use("actor_infer")
        self.phase = "validation"
        return episode_metrics(self._play(list(range(n)), list(range(n)), temperature=0.0), "eval")

    def write_checkpoint(self, tmp: Path) -> dict:
        self.roles.use("actor_train")
        self.executor.get(self.actor.call("save_checkpoint", str(tmp / "actor_train")))
        self.roles.save_rng("actor_infer", tmp / "infer_rng.pt")
        return {"before": self.before, "shaping": self.shaper.state_dict()}

    def restore(self, path: Path, state: dict) -> None:
        self.executor.get(self.actor.call("load_checkpoint", str(path / "actor_train")))
        self.roles.load_rng("actor_infer", path / "infer_rng.pt")
        self.before = state["before"]
        self.shaper.load_state_dict(state["shaping"])
        self.roles.use("actor_train", "actor_infer")
        self.weights.update(new_version=False, wait=True)

    def summary(self, final_step: int, after: dict[str, float]) -> dict:
        summary = {"steps": final_step, "before": self.before, "after": after}
        if self.before and after:
            b, f = self.before["eval/success_rate"], after["eval/success_rate"]
            print(f"held-out success rate (greedy): {b:.1%} -> {f:.1%} ({100 * (f - b):+.1f} pp) after "
                  f"{final_step} agentic steps", flush=True)
        return summary
