"""The reward worker: scores finished samples with the rewards a role configures, and contains
what a reward does wrong (a constructor that rejects its options, a hang, a non-finite score).

It imports no torch (nor do :mod:`roll_core.runtime.worker_base` and the reward registry), so a
reward worker of its own on Ray starts without loading torch and transformers: a hung reward's
replacement is up sooner, and each such process holds less memory. A reward that needs torch (a
reward model) imports it itself.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from roll_core.config.schema import RewardFailures
from roll_core.errors import RollError
from roll_core.plugins import get_plugins
from roll_core.rewards import RewardInput
from roll_core.runtime.deadline import Hung, call_with_deadline
from roll_core.runtime.worker_base import Worker, bind_devices


class RewardError(RollError):
    """A reward implementation raised on a sample, returned a non-finite score or hung (policy ``error``)."""


class RewardConfigError(RollError):
    """A reward's constructor rejected its options: deterministic, so the run stops instead of restarting."""


def _one_torch_thread() -> None:
    """One intra-op thread for torch in this process: set now where torch is loaded, and otherwise
    left to OpenMP, which reads ``OMP_NUM_THREADS`` once, when a reward first loads torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    else:
        os.environ["OMP_NUM_THREADS"] = "1"


@dataclass
class _Scorer:
    """One configured reward of a worker."""

    name: str
    plugin: str
    weight: float
    options: dict
    reward: Any = None


class RewardWorker(Worker):
    """Scores finished samples with one or more registered rewards: ``sum(weight * reward)``.

    ``rewards`` is a list of ``(name, options, weight)``; ``key`` is the config key of the role
    (for messages) and ``failures`` its policy (:class:`~roll_core.config.schema.RewardFailures`);
    ``models_here`` says model roles compute in this worker's process (the local executor's, or
    the controller's inside a Ray worker), whose torch thread count they set. One worker serves one
    domain (or the default reward), so a slow reward of one domain never holds up the others.

    A reward that misbehaves is contained here, whatever plugin it comes from:

    * a constructor that rejects its options does not kill the worker: :meth:`ready` (called by
      the pipeline right after spawning, before any long work) raises :class:`RewardConfigError`
      naming the reward and its plugin, and the run stops without restarting;
    * each reward scores in a thread of its own, given ``timeout_s`` per sample; a call past its
      deadline is abandoned and the reward rebuilt, and the result says ``replace`` so the driver
      replaces this worker (on Ray, a new process: the hung call dies with the old one);
    * a NaN or infinite score is an error, or scores 0, by policy; both counts are returned.
    """

    def __init__(self, rewards: list[tuple[str, dict, float]], run_config, key: str = "roles.reward",
                 failures: dict | None = None, models_here: bool = False, devices=None):
        bind_devices(devices)
        # A reward computes little: where no model computes (a Ray worker of its own, or a Ray
        # run's driver) one thread leaves the cores to the models' processes. Where models compute,
        # their roles set the count, and a worker built later (replacing a hung one) must keep it.
        if not models_here:
            _one_torch_thread()
        self.key, self.failures = key, RewardFailures(**(failures or {})).failure_policy()  # defaults from the schema
        self.broken: RewardConfigError | None = None
        self.closed = False
        plugins = get_plugins()
        self.scorers = [_Scorer(name, plugins.rewards.entry(name).plugin, float(weight), dict(options))
                        for name, options, weight in rewards]
        for scorer in self.scorers:
            if not self._build(scorer):
                break

    def _build(self, scorer: _Scorer) -> bool:
        try:
            scorer.reward = get_plugins().rewards.get(scorer.name)(**scorer.options)
            return True
        except Exception as exc:  # any plugin's constructor: report it, never crash the worker
            self.broken = RewardConfigError(
                f"key '{self.key}': reward '{scorer.name}' (plugin '{scorer.plugin}') failed to start with options "
                f"{scorer.options}: {type(exc).__name__}: {exc}")
            return False

    def ready(self) -> bool:
        """Raises the constructor's error, if there was one, or that the worker is closed; cheap otherwise."""
        if self.broken:
            raise self.broken
        if self.closed:
            raise RollError(f"the reward worker of '{self.key}' is closed: its rewards were released by close(), "
                            "so it scores no more; build a new worker")
        return True

    def _score_one_reward(self, scorer: _Scorer, samples: list[RewardInput], counts: dict) -> list[float]:
        name, plugin = scorer.name, scorer.plugin
        deadline = self.failures["timeout_s"] * len(samples)
        reward = scorer.reward
        try:
            scores = call_with_deadline(lambda: reward.score_batch(samples), deadline, f"reward-{name}")
        except Hung:  # abandon the call, rebuild the reward; the driver replaces this worker
            counts["replace"] = True
            self._build(scorer)
            if self.failures["on_timeout"] == "error":
                raise RewardError(f"reward '{name}' (plugin '{plugin}') did not score {len(samples)} sample(s) within "
                                  f"{deadline:g} s ({self.key}.timeout_s={self.failures['timeout_s']:g} per sample; "
                                  f"{self.key}.on_timeout: zero scores them 0 and goes on)") from None
            counts["timeouts"] += len(samples)
            return [0.0] * len(samples)
        except BaseException as exc:  # noqa: BLE001 - whatever the plugin raised, named
            raise RewardError(f"reward '{name}' (plugin '{plugin}') raised {type(exc).__name__}: {exc}") from exc
        if len(scores) != len(samples):
            raise RewardError(f"reward '{name}' (plugin '{plugin}') returned {len(scores)} scores "
                              f"for {len(samples)} samples")
        scores = [float(s) for s in scores]
        bad = {i for i, s in enumerate(scores) if not math.isfinite(s)}
        if bad:
            if self.failures["on_nonfinite"] == "error":
                first = scores[min(bad)]
                raise RewardError(f"reward '{name}' (plugin '{plugin}') returned a non-finite score ({first}) for "
                                  f"{len(bad)} of {len(samples)} sample(s); fix the reward, or set "
                                  f"{self.key}.on_nonfinite: zero to score them 0 and count them")
            counts["nonfinite"] += len(bad)
            scores = [0.0 if i in bad else s for i, s in enumerate(scores)]
        return scores

    def close(self) -> None:
        """Close every reward this worker built (:meth:`roll_core.rewards.Reward.close`), each even
        when another's close fails; the first failure is raised after, naming its reward."""
        super().close()
        self.closed = True
        failures = []
        for scorer in self.scorers:
            reward, scorer.reward = scorer.reward, None
            if reward is None:  # its constructor failed
                continue
            try:
                reward.close()
            except Exception as exc:  # noqa: BLE001 - any plugin's close: named, and the others still run
                failures.append(f"reward '{scorer.name}' (plugin '{scorer.plugin}') failed to close: "
                                f"{type(exc).__name__}: {exc}")
        if failures:
            raise RewardError("; ".join(failures))

    def score_detailed(self, samples: list[RewardInput]) -> dict:
        """``{"scores", "components": {name: [...]}, "seconds", "timeouts", "nonfinite", "replace",
        "counters": {"<reward>/<key>": n}}`` (counters: each reward's :meth:`Reward.metrics`)."""
        self.ready()
        t0 = time.perf_counter()
        counts = {"timeouts": 0, "nonfinite": 0, "replace": False}
        components = {s.name: self._score_one_reward(s, samples, counts) for s in self.scorers}
        scores = [sum(s.weight * components[s.name][i] for s in self.scorers) for i in range(len(samples))]
        counters = {f"{s.name}/{k}": float(v) for s in self.scorers for k, v in s.reward.metrics().items()}
        return {"scores": scores, "components": components, "seconds": time.perf_counter() - t0, **counts,
                "counters": counters}
