"""Plugin discovery and the registries it fills.

Where plugins come from, in order:
  1. roll's own default plugins (``DEFAULT_PLUGINS``), loaded through the very same path as
     third-party ones, so the built-ins are proof that the plugin API is enough;
  2. every installed distribution declaring an entry point in the group ``roll``
     (``[project.entry-points.roll] my_plugin = "my_pkg.plugin"``).

A plugin that fails to import, implements a hook roll does not define (a misspelled hook would
register nothing), or raises inside a hook, is recorded as *broken* with its name, version and
error, and whatever it registered is withdrawn; every other plugin keeps working.
``ROLL_STRICT_PLUGINS=1`` turns that into a hard error; ``ROLL_DISABLE_PLUGINS=a,b`` skips plugins
by plugin or distribution name.

Every process builds its own registries (``get_plugins()``), so Ray workers see the same plugins as
the driver as long as they run in the same Python environment.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata as md
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import pluggy

from roll_core import hookspecs
from roll_core.errors import PluginError, did_you_mean
from roll_core.registry import Registry

ENTRY_POINT_GROUP = "roll"

#: (plugin name, module) of the built-in plugins.
DEFAULT_PLUGINS: tuple[tuple[str, str], ...] = (
    ("core.strategies", "roll_core.default_plugins.strategies"),
    ("core.algorithms", "roll_core.default_plugins.algorithms"),
    ("core.datasets", "roll_core.default_plugins.datasets"),
    ("core.rewards", "roll_core.default_plugins.rewards"),
    ("core.schedulers", "roll_core.default_plugins.schedulers"),
    ("core.weight_syncs", "roll_core.default_plugins.weight_syncs"),
    ("core.trackers", "roll_core.default_plugins.trackers"),
    ("core.pipelines", "roll_core.default_plugins.pipelines"),
)

#: registry name -> the hook that fills it. Strategies fill two registries (see ``_strategy_register``).
REGISTRY_HOOKS: dict[str, str] = {
    "advantage_estimators": "roll_register_advantage_estimators",
    "policy_losses": "roll_register_policy_losses",
    "kl_estimators": "roll_register_kl_estimators",
    "preference_losses": "roll_register_preference_losses",
    "distill_losses": "roll_register_distill_losses",
    "datasets": "roll_register_datasets",
    "rewards": "roll_register_rewards",
    "envs": "roll_register_envs",
    "schedulers": "roll_register_schedulers",
    "weight_syncs": "roll_register_weight_syncs",
    "trackers": "roll_register_trackers",
    "pipelines": "roll_register_pipelines",
}
STRATEGY_KINDS = ("train", "infer", "critic")
# What one entry of each registry is called in messages ("unknown policy loss 'x'").
KIND_NAMES: dict[str, str] = {
    "advantage_estimators": "advantage estimator", "policy_losses": "policy loss", "kl_estimators": "kl estimator",
    "preference_losses": "preference loss", "distill_losses": "distillation loss",
    "datasets": "dataset", "rewards": "reward", "envs": "env", "schedulers": "scheduler", "weight_syncs": "weight sync", "trackers": "tracker",
    "pipelines": "pipeline",
}


@dataclass
class PluginInfo:
    """What ``roll list-plugins`` shows for one plugin."""

    name: str
    module: str
    distribution: str
    version: str
    status: str = "ok"  # ok | broken | disabled
    error: str = ""
    builtin: bool = False
    provides: dict[str, list[str]] = field(default_factory=dict)
    summary: str = ""  # its docstring's first sentence: what the listing says of a plugin that provides nothing

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _env_list(var: str) -> set[str]:
    return {x.strip() for x in os.environ.get(var, "").split(",") if x.strip()}


def _strict() -> bool:
    return os.environ.get("ROLL_STRICT_PLUGINS", "").lower() in {"1", "true", "yes"}


class RollPlugins:
    """The plugin manager plus the registries its hooks filled."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.registries: dict[str, Registry] = {
            **{f"{kind}_strategies": Registry(f"{kind} strategy") for kind in STRATEGY_KINDS},
            **{name: Registry(KIND_NAMES[name]) for name in REGISTRY_HOOKS},
        }

    # -- access -----------------------------------------------------------------------------
    def registry(self, name: str) -> Registry:
        return self.registries[name]

    def __getattr__(self, name: str) -> Registry:
        registries = self.__dict__.get("registries", {})
        if name in registries:
            return registries[name]
        raise AttributeError(name)

    def unknown_disabled(self) -> list[tuple[str, str]]:
        """What ``ROLL_DISABLE_PLUGINS`` names that no plugin here is called or comes from (a typo
        disables nothing), each with a did-you-mean of the closest name that would match ("" if none)."""
        known = sorted({name for info in self.plugins.values() for name in (info.name, info.distribution)})
        return [(name, did_you_mean(name, known)) for name in sorted(_env_list("ROLL_DISABLE_PLUGINS"))
                if name not in known]

    # -- loading ----------------------------------------------------------------------------
    def add(self, name: str, load: Callable[[], Any], *, module: str, distribution: str,
            version: str, builtin: bool = False) -> PluginInfo:
        """Import one plugin (``load()`` returns its module or object) and register it."""
        info = PluginInfo(name, module, distribution, version, builtin=builtin)
        self.plugins[name] = info
        disabled = _env_list("ROLL_DISABLE_PLUGINS")
        if name in disabled or distribution in disabled:
            info.status = "disabled"
            return info
        try:
            obj = load()
            self.pm.register(obj, name=name)
        except Exception as exc:  # a broken plugin must not take the others down
            self._mark_broken(info, f"import failed: {type(exc).__name__}: {exc}", exc)
            return info
        info.summary = first_sentence(getattr(obj, "__doc__", None))
        unknown = self._unknown_hooks(obj)
        if unknown:
            hooks = sorted(n for n, caller in vars(self.pm.hook).items() if getattr(caller, "spec", None))
            self._mark_broken(info, "it implements hooks that roll does not define and would never call: " + " ".join(
                f"'{n}' is not a roll hook.{did_you_mean(n, hooks)}" for n in unknown)
                + " (a hook that only a newer roll defines is marked @hookimpl(optionalhook=True))", None)
        return info

    def _unknown_hooks(self, obj) -> list[str]:
        """The hooks ``obj`` implements that roll does not define, other than those marked
        ``optionalhook``: pluggy accepts them and never calls them."""
        return sorted(caller.name for caller in self.pm.get_hookcallers(obj) or [] if caller.spec is None
                      and not all(impl.optionalhook for impl in caller.get_hookimpls() if impl.plugin is obj))

    def _mark_broken(self, info: PluginInfo, message: str, exc: BaseException | None) -> None:
        info.status, info.error = "broken", message
        for registry in self.registries.values():
            registry.unregister_plugin(info.name)
        if self.pm.has_plugin(info.name):
            self.pm.unregister(name=info.name)
        if _strict():
            raise PluginError(
                f"plugin '{info.name}' ({info.distribution} {info.version}) is broken: {message}. "
                "Unset ROLL_STRICT_PLUGINS to continue without it."
            ) from exc

    def call_register_hooks(self) -> None:
        """Run every registration hook, one implementation at a time, so that a failure is
        attributed to its plugin and rolled back without touching the others."""
        hooks = [("roll_register_strategies", None)] + [(h, r) for r, h in REGISTRY_HOOKS.items()]
        for hook_name, registry_name in hooks:
            hook = getattr(self.pm.hook, hook_name)
            for impl in hook.get_hookimpls():  # registration order: built-ins claim names first
                info = self.plugins.get(impl.plugin_name)
                if info is None or info.status != "ok":
                    continue
                if registry_name is None:
                    register = self._strategy_register(info.name)
                else:
                    register = self._register_into(self.registries[registry_name], info.name)
                kwargs = {"register": register}
                try:
                    impl.function(**{k: v for k, v in kwargs.items() if k in impl.argnames})
                except Exception as exc:
                    self._mark_broken(info, f"{hook_name} raised {type(exc).__name__}: {exc}", exc)
        for info in self.plugins.values():
            info.provides = self._provided_by(info.name)

    @staticmethod
    def _register_into(registry: Registry, plugin: str):
        def register(name, target, *, description: str = "", **metadata):
            registry.register(name, target, plugin=plugin, description=description, **metadata)

        return register

    def _strategy_register(self, plugin: str):
        def register(name, target, *, kind: str, description: str = "", **metadata):
            if kind not in STRATEGY_KINDS:
                raise ValueError(f"strategy '{name}': kind must be one of {STRATEGY_KINDS}, got {kind!r}")
            self.registries[f"{kind}_strategies"].register(
                name, target, plugin=plugin, description=description, **metadata
            )

        return register

    def _provided_by(self, plugin: str) -> dict[str, list[str]]:
        provided = {}
        for reg_name, registry in self.registries.items():
            names = [e.name for e in registry.entries() if e.plugin == plugin]
            if names:
                provided[reg_name] = names
        return provided

    def components(self) -> list[dict[str, str]]:
        """Every registered name: its registry, the plugin that registered it, and its description."""
        return [{"registry": reg_name, "kind": registry.kind, "name": e.name, "plugin": e.plugin,
                 "description": e.description}
                for reg_name, registry in self.registries.items() for e in registry.entries()]

    def provider_of(self, name: str) -> list[tuple[str, str]]:
        """``(kind, plugin)`` of every registry entry called ``name`` (a component's name, not a plugin's)."""
        return [(c["kind"], c["plugin"]) for c in self.components() if c["name"] == name]

    def listing(self) -> dict[str, Any]:
        """What ``roll list-plugins --json`` prints."""
        return {
            "python": {"version": sys.version.split()[0], "executable": sys.executable},
            "plugins": [p.to_dict() for p in self.plugins.values()],
            "components": self.components(),
        }


def first_sentence(doc: str | None) -> str:
    """``doc``'s first sentence on one line, without reST's literal quotes: a plugin's one-line summary
    (a plugin that registers nothing where a dependency is missing says so in it)."""
    text = " ".join((doc or "").split()).replace("``", "")
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def _dist_version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "unknown"


def _same(obj: Any) -> Any:
    return obj


def load_plugins(extra: list[tuple[str, Any]] | None = None, *, entry_points: bool = True) -> RollPlugins:
    """Build a fresh plugin manager: default plugins, installed entry points, then ``extra``.

    ``extra`` is a list of ``(name, plugin object)`` pairs registered after everything else; tests
    and notebooks use it to add a plugin without installing a distribution.
    """
    plugins = RollPlugins()
    core_version = _dist_version("roll-core")
    for name, module in DEFAULT_PLUGINS:
        plugins.add(name, functools.partial(importlib.import_module, module), module=module,
                    distribution="roll-core", version=core_version, builtin=True)
    if entry_points:
        for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist is not None else "unknown"
            version = ep.dist.version if ep.dist is not None else "unknown"
            if ep.name in plugins.plugins:
                plugins.plugins[f"{ep.name}@{dist}"] = PluginInfo(
                    ep.name, ep.value, dist, version, status="broken",
                    error=f"plugin name '{ep.name}' is already taken by "
                    f"{plugins.plugins[ep.name].distribution}",
                )
                continue
            plugins.add(ep.name, ep.load, module=ep.value, distribution=dist, version=version)
    for name, obj in extra or []:
        plugins.add(name, functools.partial(_same, obj), module=getattr(obj, "__name__", repr(obj)),
                    distribution="<in-process>", version="")
    plugins.call_register_hooks()
    return plugins


_PLUGINS: RollPlugins | None = None


def get_plugins() -> RollPlugins:
    """The process-wide plugin manager, built on first use."""
    global _PLUGINS
    if _PLUGINS is None:
        _PLUGINS = load_plugins()
    return _PLUGINS


def reset_plugins(plugins: RollPlugins | None = None) -> None:
    """Replace (or drop, so it is rebuilt) the process-wide plugin manager. Used by tests."""
    global _PLUGINS
    _PLUGINS = plugins


@contextlib.contextmanager
def plugins_added(extra: list[tuple[str, Any]]) -> Iterator[RollPlugins]:
    """Within the block, the process-wide plugins are the installed ones plus ``extra`` (``(name,
    plugin object)`` pairs: a notebook's plugins, :func:`roll_core.run`'s ``plugins``); after it,
    what they were before."""
    global _PLUGINS
    before = _PLUGINS
    _PLUGINS = load_plugins(extra)
    try:
        yield _PLUGINS
    finally:
        _PLUGINS = before
