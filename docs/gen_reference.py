"""Generate the docs site's reference pages at build time (mkdocs-gen-files runs this script;
nothing is written to the source tree): every config key from the pydantic models, and every
registered name with its description from the installed plugins.

``mkdocs build --strict`` builds the site; ``tests/test_descriptions.py`` fails when a config
field or a registered name has no description, so these pages have no holes.
"""

from __future__ import annotations

import typing

import mkdocs_gen_files
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from roll_core.config.schema import OwnRole, RollConfig, nested_models
from roll_core.plugins import get_plugins


def _type(annotation) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    text = text or str(annotation).replace("typing.", "")
    for model in nested_models(annotation):
        text = text.replace(f"{model.__module__}.{model.__qualname__}", model.__name__)
    return text.replace("|", "\\|")


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{value!r}`".replace("|", "\\|")


def _doc(model) -> str:
    return " ".join((model.__dict__.get("__doc__") or "").split())


def config_page() -> str:
    lines = ["# Config reference", "",
             "Every key of a run's config, generated from the pydantic models in `roll_core.config.schema`. "
             "Set keys in a YAML file or on the command line (`roll run key.sub=value`); `roll validate` checks "
             "them, with a did-you-mean for misspelled keys, before anything starts.", ""]
    seen: set[type] = set()

    def section(model, prefix: str) -> None:
        if model in seen:
            return
        seen.add(model)
        lines.extend([f"## `{prefix.rstrip('.') or 'top level'}`", "", _doc(model), "",
                      "| key | type | default | description |", "|---|---|---|---|"])
        nested = []
        for name, field in model.model_fields.items():
            description = (field.description or "").replace("|", "\\|").replace("\n", " ")
            sub = nested_models(field.annotation)
            if not description and sub:
                description = f"see `{prefix}{name}` below"
            lines.append(f"| `{prefix}{name}` | {_type(field.annotation)} | {_default(field)} | {description} |")
            nested += [(m, f"{prefix}{name}.") for m in sub]
        lines.append("")
        for m, p in nested:
            section(m, p)

    section(RollConfig, "")
    for own in nested_models(OwnRole):
        seen.discard(own)
        section(own, f"roles.<your role, kind {own.model_fields['kind'].default}>.")
    return "\n".join(lines)


def registry_page() -> str:
    plugins = get_plugins()
    lines = ["# Registered names", "",
             "What the installed plugins registered when this site was built (`roll list-plugins -v` "
             "prints the same for your environment).", ""]
    for registry, reg in sorted(plugins.registries.items()):
        entries = sorted(reg.entries(), key=lambda e: e.name)
        if not entries:
            continue
        lines += [f"## {registry}", "", "| name | plugin | description |", "|---|---|---|"]
        lines += [f"| `{e.name}` | {e.plugin} | {e.description.replace('|', chr(92) + '|')} |" for e in entries]
        lines.append("")
    return "\n".join(lines)


with mkdocs_gen_files.open("reference/config.md", "w") as f:
    f.write(config_page())
with mkdocs_gen_files.open("reference/registry.md", "w") as f:
    f.write(registry_page())
