"""Docs that quote real files must quote them exactly: every ``<!-- file: PATH -->`` marker in
docs/*.md is followed by a caption line and a fenced block whose body is the file's content."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- file: (\S+) -->\n`[^`]+`:\n\n```[a-z]*\n(.*?)```", re.DOTALL)
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _quotes():
    return [(doc.name, path, body) for doc in DOCS for path, body in MARKER.findall(doc.read_text())]


@pytest.mark.parametrize("tutorial, example", [("tutorial-reward-plugin.md", "reward-plugin"),
                                               ("tutorial-env-plugin.md", "env-plugin")])
def test_each_tutorial_quotes_every_file_of_its_example_package(tutorial, example):
    quoted = {path for doc, path, _ in _quotes() if doc == tutorial}
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "examples" / example).rglob("*")
             if p.suffix in (".py", ".toml", ".yaml") and p.name != "__init__.py"
             and not {"__pycache__", "build"} & set(p.parts)}  # build/: pip wheel's
    assert files <= quoted, f"not quoted in docs/{tutorial}: {sorted(files - quoted)}"


@pytest.mark.parametrize("doc, path, body", _quotes(), ids=lambda x: x if isinstance(x, str) and "/" in x else None)
def test_quoted_file_matches(doc, path, body):
    assert (ROOT / path).read_text() == body, f"{doc} quotes an outdated copy of {path}"
