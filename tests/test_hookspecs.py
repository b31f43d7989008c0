"""Every hook is documented and tested (the datasette rule), enforced here."""

import inspect
import re
from pathlib import Path

import pytest

from roll_core import hookspecs

HOOKS = sorted(name for name, obj in vars(hookspecs).items()
               if inspect.isfunction(obj) and hasattr(obj, "roll_spec"))


def test_there_are_hooks():
    assert len(HOOKS) >= 10


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_prefixed_and_documented(hook):
    assert hook.startswith("roll_")
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    for section in ("Called", "Args:", "Returns:"):
        assert section in doc, f"{hook} docstring lacks '{section}'"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_test(hook):
    tests = Path(__file__).with_name("test_hooks.py").read_text()
    assert re.search(rf"\b{hook}\b", tests), f"no test in tests/test_hooks.py exercises {hook}"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_in_docs(hook):
    docs = (Path(__file__).parents[1] / "docs" / "plugins.md").read_text()
    assert f"`{hook}`" in docs, f"docs/plugins.md does not document {hook}"
