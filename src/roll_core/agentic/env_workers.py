"""Environment workers: many environments per worker, each call bounded by a deadline.

The ``agentic`` pipeline spawns ``agentic.env_workers`` :class:`EnvWorker` s (Ray actors, or
objects in the driver on the ``local`` executor), each holding ``agentic.envs_per_worker``
environment slots and serving calls for different slots at once. The driver plays through
:class:`RemoteEnv`, a proxy with the :class:`~roll_core.envs.Env` interface, so the same episode
loop (:mod:`roll_core.agentic.episodes`) runs against local and remote environments.

What an environment can do wrong, and what happens:

* it **raises** in ``reset`` or ``step``: the call raises :class:`EnvFailed` with the environment's
  own error; the episode ends as failed (``episode/failed``) and the slot is rebuilt for its next episode;
* it **hangs**: after ``agentic.step_timeout_s`` the call is abandoned
  (:mod:`roll_core.runtime.deadline`) and raises :class:`EnvHung`; the slot gets a fresh environment
  (the stuck one is never touched again), the episode counts in ``episode/hung``, and the worker
  keeps serving its other slots.
"""

from __future__ import annotations

import os
from typing import Any

from roll_core.envs import Env
from roll_core.errors import RollError
from roll_core.plugins import get_plugins
from roll_core.runtime.deadline import Hung, call_with_deadline


class EnvFailed(RollError):
    """The environment raised; the message names it and its error."""


class EnvHung(EnvFailed):
    """The environment did not answer within ``agentic.step_timeout_s`` and was replaced."""


class EnvWorker:
    """``num_envs`` slots of environment ``env`` (built lazily, with ``options``); every call on a
    slot is bounded by ``timeout_s``."""

    def __init__(self, env: str, options: dict, num_envs: int, timeout_s: float, devices=None):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.name, self.options, self.timeout_s = env, dict(options), timeout_s
        self.env_cls = get_plugins().envs.get(env)
        self.slots: list[Env | None] = [None] * num_envs
        self.replaced = 0  # environments abandoned after a hang

    def pid(self) -> int:
        return os.getpid()

    def _call(self, slot: int, what: str, fn) -> Any:
        env = self.slots[slot]
        if env is None:
            env = self.slots[slot] = self.env_cls(**self.options)
        try:
            return call_with_deadline(lambda: fn(env), self.timeout_s, f"env-{self.name}-{slot}-{what}")
        except Hung:
            self.slots[slot] = None  # abandoned: its thread may still run, but nobody calls it again
            self.replaced += 1
            raise EnvHung(f"environment '{self.name}' did not return from {what} within "
                          f"agentic.step_timeout_s={self.timeout_s:g} s; it was replaced") from None
        except Exception as exc:  # noqa: BLE001 - an environment's bug ends its episode, not the run
            self.slots[slot] = None  # its state is unknown: the next episode gets a fresh one
            _close_quietly(env)
            raise EnvFailed(f"{what}: {type(exc).__name__}: {exc}") from None

    def reset(self, slot: int, seed: int | None) -> tuple[str, dict]:
        return self._call(slot, "reset", lambda env: env.reset(seed=seed))

    def step(self, slot: int, action: str) -> tuple[str, float, bool, bool, dict]:
        return self._call(slot, "step", lambda env: env.step(action))

    def expert_action(self, slot: int) -> str | None:
        return self._call(slot, "expert_action", lambda env: env.expert_action())

    def replaced_count(self) -> int:
        return self.replaced

    def close(self) -> None:
        for env in self.slots:
            if env is not None:
                env.close()
        self.slots = [None] * len(self.slots)


def _close_quietly(env: Env) -> None:
    """Close an environment that has just raised, so what it holds (processes, sandboxes) goes with
    it; its close may fail too, and the error already reported is the one that matters. A hung one
    is never closed: the call still running in its thread owns it."""
    try:
        env.close()
    except Exception:  # noqa: BLE001, S110 - see above
        pass


class RemoteEnv(Env):
    """Slot ``slot`` of an :class:`EnvWorker`, seen as an :class:`~roll_core.envs.Env` (its calls
    block until the worker answers; :class:`EnvFailed` surfaces as the episode's failure)."""

    def __init__(self, executor, handle, slot: int, env_cls: type[Env]):
        self.executor, self.handle, self.slot = executor, handle, slot
        self.actions = env_cls.actions

    def _call(self, method: str, *args):
        return self.executor.get(self.executor.invoke(self.handle, method, (self.slot, *args), {}))

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return self._call("reset", seed)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return self._call("step", action)

    def expert_action(self) -> str | None:
        return self._call("expert_action")
