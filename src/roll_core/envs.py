"""Environment interface for agentic, multi-turn RL (GEM-style, after gymnasium).

Observations and actions are text. Environments are registered through ``roll_register_envs``;
the ``roll-envs`` plugin brings ``frozen_lake``. ``reset(seed)`` must make an episode deterministic
(``roll check-plugin`` replays one twice). Two ``info`` keys carry meaning for training:
``success`` (the episode reached its goal: success-rate metrics) and ``state_hash`` (an int naming
the state the next action is taken in: GiGPO's step groups).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Env(ABC):
    """Constructed with the config's env options as keyword arguments."""

    @abstractmethod
    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode: ``(observation, info)``."""

    @abstractmethod
    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply the model's action: ``(observation, reward, terminated, truncated, info)``."""

    def close(self) -> None:
        """Release resources (processes, sandboxes)."""
