"""`roll plugin new KIND NAME`: every kind's package is written, and its skeleton passes roll's
contract checks unchanged (`nox -s example_plugins` also installs each with pip and runs its tests)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
from conftest import run_roll

from roll_core.scaffold import KINDS


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_new_plugin_of_each_kind_passes_its_contract_checks_and_its_own_tests(kind, tmp_path, roll_plugins,
                                                                                monkeypatch):
    from roll_core.contracts import check_plugin

    name = f"my_{kind}"
    result = run_roll("plugin", "new", kind, name, "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    root = tmp_path / f"roll-my-{kind}"
    assert f"pip install -e '{root}[test]'" in result.stdout
    pyproject = (root / "pyproject.toml").read_text()
    assert f'[project.entry-points.roll]\n{name} = "roll_{name}.plugin"' in pyproject
    assert {p.name for p in root.iterdir()} == {"pyproject.toml", "README.md", "src", "tests"}

    monkeypatch.syspath_prepend(str(root / "src"))
    plugin = importlib.import_module(f"roll_{name}.plugin")
    report = check_plugin(name, roll_plugins((name, plugin)))
    assert report.ok and report.results, report.failures()
    # the package's own unit test (the entry-point tests need it installed: the nox session does that)
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            f"{root / 'tests' / f'test_{name}.py'}::test_{name}"], capture_output=True, text=True, cwd=root,
                           env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert tests.returncode == 0, tests.stdout[-3000:]


def test_bad_kinds_names_and_existing_directories_are_refused(tmp_path):
    assert "invalid choice: 'widget'" in run_roll("plugin", "new", "widget", "x", "--dir", str(tmp_path)).stderr
    assert "must be a lowercase Python identifier" in run_roll("plugin", "new", "reward", "My-Reward",
                                                               "--dir", str(tmp_path)).stderr
    assert run_roll("plugin", "new", "reward", "twice", "--dir", str(tmp_path)).returncode == 0
    again = run_roll("plugin", "new", "reward", "twice", "--dir", str(tmp_path))
    assert again.returncode == 2 and "exists already" in again.stderr


def test_a_package_that_cannot_be_written_is_one_error_and_leaves_nothing_behind(tmp_path, monkeypatch):
    from pathlib import Path

    from roll_core.errors import RollError
    from roll_core.scaffold import new_plugin

    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a directory cannot be made under a file
    with pytest.raises(RollError, match=r"cannot write the package at .*a-file/roll-x: Not a directory"):
        new_plugin("reward", "x", blocked)
    root = new_plugin("reward", "x", tmp_path / "new" / "dirs")  # missing directories are made
    assert root == tmp_path / "new" / "dirs" / "roll-x" and (root / "pyproject.toml").is_file()
    assert [p.name for p in root.parent.iterdir()] == ["roll-x"]  # written whole, then renamed

    def full(self, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "rename", full)  # a failure once the files are written: they go too
    with pytest.raises(RollError, match="cannot write the package at .*roll-y: No space left on device"):
        new_plugin("reward", "y", root.parent)
    assert [p.name for p in root.parent.iterdir()] == ["roll-x"]
