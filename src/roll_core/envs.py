"""Environment interface for agentic, multi-turn RL (GEM-style, after gymnasium).

Observations and actions are text. Environments are registered through ``roll_register_envs``;
the ``roll_envs`` plugin brings FrozenLake, Sokoban, GEM and tool-use environments.
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
