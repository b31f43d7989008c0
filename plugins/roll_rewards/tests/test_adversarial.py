"""Must-show: every attack in ``adversarial.py`` scores 0 and changes nothing, as root (what CI is) and
as an unprivileged user. The battery runs in a worker process of its own with a secret in its real
environment, so a leak through ``/proc/<pid>/environ`` would be caught (a secret set with
``monkeypatch.setenv`` never reaches that file)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

import roll_core
import roll_rewards

HERE = Path(__file__).parent
SYSTEM_PYTHON = "/usr/bin/python3"


def _check(out: subprocess.CompletedProcess, secret: str) -> None:
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    attacks = [r for r in rows if r["name"] != "worker_alive_and_honest_program_scores_1"]
    failed = {r["name"]: r["problems"] for r in rows if not r["ok"]}
    assert out.returncode == 0 and not failed, f"{failed}\n{out.stderr[-3000:]}"
    assert len(attacks) >= 30 and rows[-1]["name"] == "worker_alive_and_honest_program_scores_1"
    assert secret not in out.stdout + out.stderr


def test_every_attack_fails_as_this_user():
    secret = f"secret-{uuid.uuid4().hex}"
    out = subprocess.run([sys.executable, str(HERE / "adversarial.py")], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "ROLL_WORKER_SECRET": secret}, check=False)
    _check(out, secret)


@pytest.mark.skipif(os.geteuid() != 0, reason="already unprivileged: the test above ran as this user")
def test_every_attack_fails_as_an_unprivileged_user():
    """As uid 65534, on the system's Python (the worker's may sit in root's home), from a copy of the
    sources in a directory that user can read."""
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import pluggy, pytest"], capture_output=True, check=False)
    assert probe.returncode == 0, ("the unprivileged run needs the system's Python with pytest and pluggy: "
                                   "apt-get install python3-pytest python3-pluggy")
    tree = tempfile.mkdtemp(prefix="roll-adversarial-")
    try:
        os.chmod(tree, 0o755)
        for package in (roll_core, roll_rewards):
            shutil.copytree(Path(package.__file__).parent, Path(tree, package.__name__),
                            ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(HERE / "adversarial.py", tree)
        secret = f"secret-{uuid.uuid4().hex}"
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": tree, "PYTHONDONTWRITEBYTECODE": "1",
               "ROLL_WORKER_SECRET": secret}
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON,
                              f"{tree}/adversarial.py"], capture_output=True, text=True, timeout=600, env=env,
                             cwd=tree, check=False)
        _check(out, secret)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
