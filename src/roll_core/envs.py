"""Environment interface for agentic, multi-turn RL (GEM-style, after gymnasium).

Observations and actions are text; an observation may also carry images (:class:`Observation`, for
image-text models: :mod:`roll_core.multimodal`). Environments are registered through ``roll_register_envs``;
the ``roll-envs`` plugin brings ``frozen_lake``. ``reset(seed)`` must make an episode deterministic
(``roll check-plugin`` replays one twice). Two ``info`` keys carry meaning for training:
``success`` (the episode reached its goal: success-rate metrics) and ``state_hash`` (an int naming
the state the next action is taken in: GiGPO's step groups).

Two optional members serve agentic training without a model: ``actions``, the action texts of an
environment with a small fixed set (random policies and careless teachers draw from it), and
``expert_action()``, the action a solver would take now (the supervised warm-up imitates a teacher
that follows it, ``agentic.teacher_noise`` of the time taking a random action instead).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

from roll_core.errors import ConfigError


@dataclass(frozen=True)
class Observation:
    """An observation with images: ``text`` holds one ``<image>`` where each of ``images`` goes, in
    order (file paths, PIL images or ``[H, W, 3]`` uint8 arrays, as a data row's ``images``). The
    model's processor turns each into its image tokens and pixels, as it does a prompt's."""

    text: str
    images: Sequence[Any] = ()


def observation_parts(observation: str | Observation) -> tuple[str, list]:
    """``(text, images)`` of an environment's observation (a plain string has no images)."""
    if isinstance(observation, Observation):
        return observation.text, list(observation.images)
    if not isinstance(observation, str):
        raise TypeError(f"an observation is a str or a roll_core.envs.Observation, got {type(observation).__name__}")
    return observation, []


class Env(ABC):
    """Constructed with the config's env options as keyword arguments."""

    #: the action texts, for an environment with a small fixed set (empty: free text)
    actions: tuple[str, ...] = ()
    #: True where observations carry images (:class:`Observation`): the run then needs an image-text
    #: model and strategies that read images, checked before any worker starts
    image_observations: bool = False

    @abstractmethod
    def reset(self, seed: int | None = None) -> tuple[str | Observation, dict[str, Any]]:
        """Start an episode: ``(observation, info)``."""

    @abstractmethod
    def step(self, action: str) -> tuple[str | Observation, float, bool, bool, dict[str, Any]]:
        """Apply the model's action: ``(observation, reward, terminated, truncated, info)``."""

    def expert_action(self) -> str | None:
        """The action a solver would take in the current state, or None: no expert (the default)."""
        return None

    def close(self) -> None:
        """Release resources (processes, sandboxes)."""


def build_env(env_cls: type[Env], name: str, options: dict[str, Any], where: str) -> Env:
    """``env_cls(**options)``, the environment registered as ``name``; options or values its
    constructor refuses (``TypeError``, ``ValueError``) are a :class:`ConfigError` that ``where``
    starts (``key 'agentic.env_options'``, or ``roll play``'s ``--options``)."""
    try:
        return env_cls(**options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where} for environment '{name}': {exc}") from None
