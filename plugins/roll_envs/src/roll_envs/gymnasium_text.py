"""Any gymnasium environment with a discrete action space, as text: ``gymnasium`` with option ``id``.

* **Observation**: the observation itself when the environment's observation space is
  ``gymnasium.spaces.Text``; otherwise its ``ansi`` rendering when it has one (colour codes
  removed), else ``str(observation)``. ``observation: str`` forces the last.
* **Action**: the first of ``action_names`` named in the reply (a whole word, case-insensitive), or
  else the first integer in ``0 .. n-1``. A reply with neither costs ``invalid_action_penalty``
  (-0.1), the environment is not stepped and the step counts toward ``max_steps``.
* **info**: gymnasium's, plus ``success`` (it terminated with a reward of at least
  ``success_reward``, 1.0 by default) and ``state_hash`` (a CRC-32 of the observation text).
* ``truncated`` after ``max_steps`` replies, or when gymnasium truncates.

Other keyword options go to ``gymnasium.make``. For example, CliffWalking with named moves::

    agentic:
      env: gymnasium
      env_options: {id: CliffWalking-v1, action_names: [up, right, down, left], max_steps: 30}
"""

from __future__ import annotations

import re
import zlib
from typing import Any

from roll_core.envs import Env

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class GymnasiumText(Env):
    def __init__(self, id: str = "CliffWalking-v1", action_names: list[str] | None = None, max_steps: int = 50,
                 invalid_action_penalty: float = -0.1, success_reward: float = 1.0, observation: str = "auto",
                 **make_options: Any):
        import gymnasium as gym

        if observation not in ("auto", "str"):
            raise ValueError(f"observation must be 'auto' or 'str', got {observation!r}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        spec = gym.spec(id)  # an unknown id raises here, naming the close ones
        modes = (spec.kwargs.get("render_modes") or [])
        ansi = observation == "auto" and "ansi" in _render_modes(gym, id, modes)
        self._env = gym.make(id, render_mode="ansi" if ansi else None, **make_options)
        if not isinstance(self._env.action_space, gym.spaces.Discrete):
            raise ValueError(f"{id} has action space {self._env.action_space}; only Discrete ones are readable as text")
        self.n = int(self._env.action_space.n)
        if action_names is not None and len(action_names) != self.n:
            raise ValueError(f"{id} has {self.n} actions, action_names names {len(action_names)}")
        self.action_names = [a.lower() for a in action_names] if action_names else None
        self.actions = tuple(action_names) if action_names else tuple(str(i) for i in range(self.n))
        self.text_space = isinstance(self._env.observation_space, gym.spaces.Text)
        self.ansi, self.max_steps = ansi, max_steps
        self.invalid_action_penalty, self.success_reward = invalid_action_penalty, success_reward
        self._steps, self._text = 0, ""

    def _render(self, observation: Any) -> str:
        if self.text_space:
            return str(observation)
        if self.ansi:
            return _ANSI.sub("", str(self._env.render())).strip("\n")
        return str(observation)

    def _info(self, info: dict, success: bool) -> dict[str, Any]:
        return {**info, "success": success, "state_hash": zlib.crc32(self._text.encode())}

    def parse(self, text: str) -> int | None:
        """The action the reply names, or None."""
        words = re.findall(r"[A-Za-z]+|\d+", text)
        if self.action_names:
            for word in words:
                if word.lower() in self.action_names:
                    return self.action_names.index(word.lower())
        for word in words:
            if word.isdigit() and int(word) < self.n:
                return int(word)
        return None

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        observation, info = self._env.reset(seed=seed)
        self._steps, self._text = 0, self._render(observation)
        return self._text, self._info(info, False)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._steps += 1
        out_of_steps = self._steps >= self.max_steps
        move = self.parse(action)
        if move is None:
            return self._text, self.invalid_action_penalty, False, out_of_steps, self._info({"invalid_action": True}, False)
        observation, reward, terminated, truncated, info = self._env.step(move)
        self._text = self._render(observation)
        success = bool(terminated) and float(reward) >= self.success_reward
        return self._text, float(reward), bool(terminated), bool(truncated) or (out_of_steps and not terminated), \
            self._info(info, success)

    def close(self) -> None:
        self._env.close()


def _render_modes(gym, id: str, registered: list[str]) -> list[str]:
    """The render modes the environment's class declares (registration rarely lists them)."""
    if registered:
        return registered
    entry = gym.spec(id).entry_point
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        import importlib

        entry = getattr(importlib.import_module(module), name)
    return list(getattr(entry, "metadata", {}).get("render_modes", []))
