"""Every installed GEM environment (``gem-llm``), by name: ``gem:<GEM id>``, e.g.
``gem:game:GuessTheNumber-v0-easy`` or ``gem:rg:maze``.

GEM's environments already speak text (``reset(seed) -> (observation, info)``, ``step(action) ->
(observation, reward, terminated, truncated, info)``), so the adapter only fills the two ``info``
keys roll trains with, when GEM does not give them:

* ``success``: the episode terminated with a last reward of at least ``success_reward`` (1.0,
  GEM's ``LanguageGameReward.success_reward``; games end with partial credit otherwise, e.g. Guess
  The Number's closeness at the last turn);
* ``state_hash``: a CRC-32 of the observation text (two turns that showed the agent the same text are
  one GiGPO step group).

GEM's ``info["suffix"]`` (the prompt for the next move, e.g. "Enter your next guess.") is appended to
the observation. ``reset(seed)`` seeds GEM, which seeds Python's and NumPy's global generators (GEM's
own convention), so an episode is deterministic under its seed. The constructor's keyword options
override the GEM id's registered ones, except ``success_reward``, the adapter's own.

Environments of GEM's dataset families (``math:``, ``code:``, ``qa:``, ``eval:``, ``logic:``) load
their data from the Hugging Face Hub when built: they need the network (or a warm HF cache). The
game (``game:``) and reasoning-gym (``rg:``) families are generated locally.

Registered by the ``gem`` plugin of roll-envs only when ``gem`` is installed
(``pip install 'roll-envs[gem]'``); importing GEM takes about 2 s, which the plugin pays once per
process that loads plugins.
"""

from __future__ import annotations

import zlib
from typing import Any

from roll_core.envs import Env


class GemEnv(Env):
    """One GEM environment; subclasses made by :func:`gem_env_class` name which (``gem_id``)."""

    gem_id: str = ""

    def __init__(self, success_reward: float = 1.0, **options: Any):
        import gem

        if not self.gem_id:
            raise TypeError("GemEnv is built through a registered name (gem:<id>), which fixes the GEM id")
        self.success_reward = success_reward
        self._env = gem.make(self.gem_id, **options)

    def _text(self, observation: Any, info: dict) -> str:
        text = observation if isinstance(observation, str) else str(observation)
        suffix = info.get("suffix")
        return f"{text}\n{suffix}" if suffix else text

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        observation, info = self._env.reset(seed=seed)
        text = self._text(observation, info)
        return text, {**info, "success": False, "state_hash": info.get("state_hash", zlib.crc32(text.encode()))}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        observation, reward, terminated, truncated, info = self._env.step(action)
        text = self._text(observation, info)
        info = {**info, "state_hash": info.get("state_hash", zlib.crc32(text.encode()))}
        info.setdefault("success", bool(terminated) and float(reward) >= self.success_reward)
        return text, float(reward), bool(terminated), bool(truncated), info

    def close(self) -> None:
        close = getattr(self._env, "close", None)
        if close is not None:
            close()


def gem_env_class(gem_id: str) -> type[GemEnv]:
    """A :class:`GemEnv` subclass bound to ``gem_id`` (what the registry holds for ``gem:<gem_id>``)."""
    name = "Gem_" + "".join(c if c.isalnum() else "_" for c in gem_id)
    return type(name, (GemEnv,), {"gem_id": gem_id, "__doc__": f"GEM's {gem_id}, through roll's Env interface."})


def gem_ids() -> list[str]:
    """The ids of every environment GEM registers."""
    from gem.envs.registration import ENV_REGISTRY

    return sorted(ENV_REGISTRY)
