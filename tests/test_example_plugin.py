"""The example third-party reward plugin (``examples/reward-plugin``), as a user gets it: built and
installed alone with pip into an empty directory, then found by roll through its entry point,
contract-checked, used by name in a config, and its own test suite run against the installed copy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "reward-plugin"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    # Built from a copy: setuptools writes build/ and *.egg-info next to the sources.
    source = tmp_path_factory.mktemp("src") / "reward-plugin"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    # --no-deps: its one dependency, roll-core, is this checkout; everything else comes from the
    # example's own pyproject (build backend included, in pip's isolated build environment).
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                          str(source)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]))
    return target, env


def _roll(env, *args, cwd=None):
    return subprocess.run([sys.executable, "-m", "roll_core.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=cwd)


def test_installed_alone_and_listed(installed):
    target, env = installed
    assert (target / "roll_numeric_reward" / "reward.py").is_file()
    assert not (target / "roll_core").exists()  # the plugin ships only itself
    out = _roll(env, "list-plugins", "--json")
    assert out.returncode == 0, out.stderr
    plugin = next(p for p in json.loads(out.stdout)["plugins"] if p["name"] == "numeric")
    assert plugin["distribution"] == "roll-numeric-reward" and plugin["version"] == "0.1.0"
    assert plugin["status"] == "ok" and plugin["provides"] == {"rewards": ["numeric_closeness"]}


def test_contract_checks_and_config_by_name(installed):
    _, env = installed
    out = _roll(env, "check-plugin", "roll-numeric-reward")
    assert out.returncode == 0 and "0 failed" in out.stdout, out.stdout + out.stderr
    out = _roll(env, "validate", str(EXAMPLE / "config.yaml"))
    assert out.returncode == 0, out.stderr
    # Without the plugin the same config is refused before anything starts.
    bare = _roll(dict(os.environ), "validate", str(EXAMPLE / "config.yaml"))
    assert bare.returncode == 2 and "unknown reward 'numeric_closeness'" in bare.stderr


def test_its_own_tests_pass_against_the_installed_copy(installed, tmp_path):
    _, env = installed
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests"),
                          "--rootdir", str(EXAMPLE)], capture_output=True, text=True, timeout=900, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "passed" in out.stdout and "failed" not in out.stdout
