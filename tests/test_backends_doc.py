"""docs/backends.md's matrix says what every strategy registers: the core's and those of the plugins
in this repository, their hooks read from source (registering imports no engine, so none needs to be
installed). A registration that changes without the page fails here, with the row to write."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "backends.md"
TABLE = re.compile(r"<!-- backends:matrix -->\n(.*?)\n\n", re.DOTALL)
HEADER = ["| strategy | package | `actor_train` | `critic` | `actor_infer` | `reference` | LoRA | packed rows "
          "| `compile` | images | `strategy_options` |", "|---|---|---|---|---|---|---|---|---|---|---|"]


def _registrations() -> list[tuple[str, str, dict]]:
    """``(name, package, metadata)`` of every strategy registration, the core's first."""
    found: list[tuple[str, str, dict]] = []
    hooks = [("roll-core", importlib.import_module("roll_core.default_plugins.strategies"))]
    for path in sorted(ROOT.glob("plugins/roll_*/src/roll_*/plugin.py")):
        sys.path.insert(0, str(path.parents[1]))  # the package's own modules, for its options model
        spec = importlib.util.spec_from_file_location(f"_backends_doc_{path.parent.name}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        hooks.append((path.parent.name.replace("_", "-"), module))
    for package, module in hooks:
        if hasattr(module, "roll_register_strategies"):
            module.roll_register_strategies(
                register=lambda name, target, *, description="", package=package, **meta:
                found.append((name, package, meta)))
    return found


def _options(kinds: dict[str, dict]) -> str:
    """The option names of a strategy's registrations, each once; one that not every kind takes
    names the kinds that do."""
    fields: dict[str, list[str]] = {}
    for kind, meta in kinds.items():
        if meta.get("options"):
            module, _, cls = meta["options"].partition(":")
            for name in getattr(importlib.import_module(module), cls).model_fields:
                fields.setdefault(name, []).append(kind)
    return ", ".join(f"`{name}`" + ("" if len(have) == len(kinds) else f" ({', '.join(have)})")
                     for name, have in fields.items()) or "-"


@contextlib.contextmanager
def _plugin_sources():
    """The plugins' modules importable from source for the block, and gone from ``sys.path`` and
    ``sys.modules`` after it, so no other test sees a plugin this venv did not install."""
    path, modules = list(sys.path), set(sys.modules)
    try:
        yield
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if name.split(".")[0].startswith(("roll_", "_backends_doc_")) and not name.startswith("roll_core"):
                del sys.modules[name]


def matrix() -> list[str]:
    """The page's table, one row per strategy name, from the registrations."""
    with _plugin_sources():
        return _rows()


def _rows() -> list[str]:
    names: dict[str, list[tuple[str, dict]]] = {}
    for name, package, meta in _registrations():
        names.setdefault(name, []).append((package, meta))
    rows = list(HEADER)
    for name, entries in names.items():
        kinds = {meta["kind"]: meta for _, meta in entries}
        infer = kinds.get("infer")

        def yes(flag: bool) -> str:
            return "yes" if flag else "-"

        def which(key: str) -> str:
            return ", ".join(kind for kind, meta in kinds.items() if meta.get(key)) or "-"

        rows.append(" | ".join([
            f"| `{name}`", entries[0][0], yes("train" in kinds), yes("critic" in kinds),
            yes(infer is not None and infer.get("generates", True)), yes(infer is not None),
            which("lora"), which("packed_sequences"), which("compiles"),
            which("images"), _options(kinds)]) + " |")
    return rows


def test_the_backends_page_shows_every_registration():
    installed = "roll_megatron" in sys.modules
    found = TABLE.search(PAGE.read_text())
    assert found, "docs/backends.md lacks its <!-- backends:matrix --> table"
    expected = matrix()
    assert found[1].split("\n") == expected, "docs/backends.md's matrix is out of date; it should read:\n" + \
        "\n".join(expected)
    assert ("roll_megatron" in sys.modules) == installed  # a plugin read from source is not left imported
