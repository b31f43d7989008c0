"""Role workers. One worker hosts one strategy (or one reward) for one role.

Workers are plain classes: the ``local`` executor instantiates them in the driver, the ``ray``
executor wraps them in ``ray.remote``. A worker looks its strategy up in *its own process's*
plugin registries, so whatever is installed (entry points) is available inside Ray workers too.
"""

from __future__ import annotations

import os
import time

import torch

from roll_core.errors import RollError
from roll_core.plugins import get_plugins
from roll_core.rewards import RewardInput


class RewardError(RollError):
    """A reward implementation raised on a sample."""


class RoleWorker:
    """Hosts a train, infer or critic strategy (``kind``)."""

    def __init__(self, role: str, kind: str, model_path: str, role_config, run_config, seed: int):
        torch.set_num_threads(run_config.torch_threads)
        self.role, self.kind = role, kind
        cls = get_plugins().registry(f"{kind}_strategies").get(role_config.strategy)
        self.strategy = cls(model_path, role_config, run_config, seed)

    # -- inference ------------------------------------------------------------------------------
    def generate(self, batch, **sampling):
        return self.strategy.generate(batch, **sampling)

    def compute_log_probs(self, batch, temperature: float, distribution: bool = False):
        return self.strategy.compute_log_probs(batch, temperature, distribution)

    def compute_values(self, batch):
        return self.strategy.compute_values(batch)

    def rng_state(self):
        return self.strategy.rng_state()

    def set_rng_state(self, state) -> None:
        self.strategy.set_rng_state(state)

    # -- training -------------------------------------------------------------------------------
    def train_step(self, batch) -> dict:
        return self.strategy.train_step(batch)

    def sft_step(self, batch, lr: float) -> dict:
        return self.strategy.sft_step(batch, lr)

    def save_checkpoint(self, path: str) -> None:
        self.strategy.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.strategy.load_checkpoint(path)

    # -- weight sync ----------------------------------------------------------------------------

    def weight_bucket_list(self, bucket_bytes: int) -> list:
        return list(self.strategy.weight_buckets(bucket_bytes))

    def load_weight_buckets(self, buckets: list) -> int:
        for bucket in buckets:
            self.strategy.load_weights(bucket)
        return sum(len(b) for b in buckets)

    def pid(self) -> int:
        return os.getpid()


class RewardWorker:
    """Scores finished samples with one or more registered rewards: ``sum(weight * reward)``.

    ``rewards`` is a list of ``(name, options, weight)``. One worker serves one domain (or the
    default reward), so a slow reward of one domain never holds up the others.
    """

    def __init__(self, rewards: list[tuple[str, dict, float]], run_config):
        torch.set_num_threads(1)
        plugins = get_plugins()
        self.rewards = []
        for name, options, weight in rewards:
            entry = plugins.rewards.entry(name)
            self.rewards.append((name, entry.plugin, float(weight), plugins.rewards.get(name)(**options)))

    def _score_one_reward(self, name: str, plugin: str, reward, samples: list[RewardInput]) -> list[float]:
        try:
            scores = reward.score_batch(samples)
        except Exception as exc:
            raise RewardError(f"reward '{name}' (plugin '{plugin}') raised {type(exc).__name__}: {exc}") from exc
        if len(scores) != len(samples):
            raise RewardError(f"reward '{name}' (plugin '{plugin}') returned {len(scores)} scores "
                              f"for {len(samples)} samples")
        return [float(s) for s in scores]

    def score_detailed(self, samples: list[RewardInput]) -> dict:
        """``{"scores": [...], "components": {name: [...]}, "seconds": float}``."""
        t0 = time.perf_counter()
        components = {name: self._score_one_reward(name, plugin, reward, samples)
                      for name, plugin, _, reward in self.rewards}
        scores = [sum(w * components[name][i] for name, _, w, _ in self.rewards) for i in range(len(samples))]
        return {"scores": scores, "components": components, "seconds": time.perf_counter() - t0}

    def pid(self) -> int:
        return os.getpid()
