"""Everything a user configures or names is described: the docs site's reference is generated from
these descriptions (docs/gen_reference.py), so a field, hook or registered name without one is a
hole in the reference. (Hooks: tests/test_hookspecs.py.)"""


import pytest
from pydantic import BaseModel

from roll_core.config.schema import OwnRole, RollConfig, nested_models


def config_fields() -> list[tuple[str, type[BaseModel], str]]:
    """``(key, model, field)`` of every field reachable from RollConfig (roles of one's own too)."""
    out, seen = [], set()

    def walk(model, prefix):
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            out.append((prefix + name, model, name))
            for nested in nested_models(field.annotation):
                walk(nested, f"{prefix}{name}.")
    walk(RollConfig, "")
    for own in nested_models(OwnRole):
        walk(own, "roles.<own>.")
    return out


@pytest.mark.parametrize("key, model, name", config_fields(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_config_field_has_a_description(key, model, name):
    field = model.model_fields[name]
    sections = [m for m in nested_models(field.annotation) if m.__dict__.get("__doc__")]
    assert field.description or sections, f"config key '{key}' ({model.__name__}.{name}) has no description"


def test_every_registered_name_has_a_description():
    from roll_core.plugins import get_plugins

    plugins = get_plugins()
    bare = [f"{registry} '{entry.name}' (plugin {entry.plugin})" for registry, reg in plugins.registries.items()
            for entry in reg.entries() if not entry.description.strip()]
    assert not bare, "registered without a description: " + "; ".join(bare)
    assert sum(len(r) for r in plugins.registries.values()) > 50  # the built-ins and the installed plugins
