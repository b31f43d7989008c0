"""Errors a user can cause. Each carries one clear message naming the key, file or plugin and what to do.

The CLI prints ``RollError`` messages without a traceback and exits non-zero; anything else is a bug
in roll or a plugin and keeps its traceback.
"""

from __future__ import annotations

import difflib


class RollError(Exception):
    """Base class of user-facing errors."""


class ConfigError(RollError):
    """A config file or override is invalid."""


class RegistryError(RollError, KeyError):
    """An unknown or duplicate registered name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class PluginError(RollError):
    """A plugin failed to load or raised in a hook while ``ROLL_STRICT_PLUGINS=1``."""


def did_you_mean(name: str, candidates) -> str:
    """``" Did you mean 'x'?"`` for the closest candidate, or ``""`` when none is close."""
    match = difflib.get_close_matches(str(name), [str(c) for c in candidates], n=1, cutoff=0.6)
    return f" Did you mean '{match[0]}'?" if match else ""


class WorkerLostError(RollError):
    """A worker process died or stopped answering; the pipeline may restart from a checkpoint."""
