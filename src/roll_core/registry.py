"""Typed registries: name -> implementation, filled by plugins through the ``roll_register_*`` hooks.

A registration is either the object itself or a lazy target string ``"package.module:attribute"``
that is imported on first ``get``. Lazy targets are what keep ``roll list-plugins`` fast and free of
heavy imports: listing only needs names, and nothing touches torch or vLLM until a run asks for it.

Errors are meant to be read by users:
  * registering a name twice names both plugins;
  * an unknown name lists the valid ones and suggests the closest.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from roll_core.errors import RegistryError, did_you_mean

T = TypeVar("T")


def import_target(target: str) -> Any:
    """Import ``"pkg.mod:attr"`` (or ``"pkg.mod:Outer.attr"``) and return the attribute."""
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise RegistryError(f"invalid target '{target}': expected 'package.module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class Entry(Generic[T]):
    """One registered implementation."""

    name: str
    target: Any  # the object, or a "pkg.mod:attr" string until first use
    plugin: str
    description: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def is_loaded(self) -> bool:
        return not isinstance(self.target, str)

    def missing_packages(self) -> dict[str, str]:
        """``{module: how to install it}`` of the packages it registered as ``requires`` (an engine, a
        tracker's service) that are not installed here, found without importing them (an engine's
        import can take seconds)."""
        import importlib.util

        return {module: hint for module, hint in self.metadata.get("requires", {}).items()
                if importlib.util.find_spec(module) is None}


class Registry(Generic[T]):
    """Name -> implementation for one kind of component (``kind`` is used in messages)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def register(
        self,
        name: str,
        target: T | str,
        *,
        plugin: str = "<direct>",
        description: str = "",
        **metadata: Any,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{self.kind}: a registered name must be a non-empty string, got {name!r}")
        if name in self._entries:
            other = self._entries[name].plugin
            raise RegistryError(
                f"{self.kind} '{name}' is registered twice: by plugin '{other}' and by plugin "
                f"'{plugin}'. Uninstall or disable one of them (ROLL_DISABLE_PLUGINS={plugin})."
            )
        self._entries[name] = Entry(name, target, plugin, description, dict(metadata))

    def unregister_plugin(self, plugin: str) -> None:
        """Drop everything one plugin registered (used when its hook fails half-way)."""
        self._entries = {k: e for k, e in self._entries.items() if e.plugin != plugin}

    def entry(self, name: str) -> Entry[T]:
        try:
            return self._entries[name]
        except KeyError:
            valid = ", ".join(sorted(self._entries)) or "(none registered)"
            raise RegistryError(
                f"unknown {self.kind} '{name}'.{did_you_mean(name, self._entries)} Valid names: {valid}"
            ) from None

    def get(self, name: str) -> T:
        """The implementation registered as ``name``, importing a lazy target on first use."""
        entry = self.entry(name)
        if isinstance(entry.target, str):
            try:
                entry.target = import_target(entry.target)
            except RegistryError:
                raise
            except Exception as exc:
                raise RegistryError(
                    f"{self.kind} '{name}' from plugin '{entry.plugin}' failed to import "
                    f"'{entry.target}': {type(exc).__name__}: {exc}"
                ) from exc
        return entry.target

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry[T]]:
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
