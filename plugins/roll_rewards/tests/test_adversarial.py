"""Must-show: every attack in ``adversarial.py`` scores 0 and changes nothing, as root (what CI is) and
as an unprivileged user. Each battery runs in a worker process of its own with a secret in its real
environment, so a leak through ``/proc/<pid>/environ`` would be caught (a secret set with
``monkeypatch.setenv`` never reaches that file). The two users' batteries run at the same time
(32 s for both on 2 cores; each runs an attack's script beside its scored call)."""

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


class Battery:
    """One run of ``adversarial.py`` in a worker process of its own, started now and read by
    :meth:`result`, so the two users' runs overlap: much of each waits out its attacks' wall
    limits, and each checks only its own marker, canary and secret."""

    def __init__(self, argv: list[str], env: dict, cwd: str | None = None):
        self.secret = f"secret-{uuid.uuid4().hex}"
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                                        env={**env, "ROLL_WORKER_SECRET": self.secret})

    def result(self) -> subprocess.CompletedProcess:
        stdout, stderr = self.process.communicate(timeout=600)
        return subprocess.CompletedProcess(self.process.args, self.process.returncode, stdout, stderr)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def _system_python_ready() -> bool:
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import pluggy, pytest"], capture_output=True, check=False)
    return probe.returncode == 0


def _selected(request: pytest.FixtureRequest, test) -> bool:
    """Whether this session runs ``test`` (``-k`` may have deselected it): a battery nobody reads
    would only take cores from the one that is read."""
    return any(getattr(item, "function", None) is test for item in request.session.items)


@pytest.fixture(scope="module")
def batteries(request):
    """``this_user`` when its test runs; ``unprivileged`` as uid 65534 when its test runs, this is root
    and the system's Python can run it: on that Python (the worker's may sit in root's home), from a
    copy of the sources in a directory that user can read."""
    started = {}
    if _selected(request, test_every_attack_fails_as_this_user):
        started["this_user"] = Battery([sys.executable, str(HERE / "adversarial.py")], dict(os.environ))
    tree = tempfile.mkdtemp(prefix="roll-adversarial-")
    try:
        if _selected(request, test_every_attack_fails_as_an_unprivileged_user) and os.geteuid() == 0 \
                and _system_python_ready():
            os.chmod(tree, 0o755)
            for package in (roll_core, roll_rewards):
                shutil.copytree(Path(package.__file__).parent, Path(tree, package.__name__),
                                ignore=shutil.ignore_patterns("__pycache__"))
            shutil.copy(HERE / "adversarial.py", tree)
            env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": tree, "PYTHONDONTWRITEBYTECODE": "1"}
            started["unprivileged"] = Battery(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                               SYSTEM_PYTHON, f"{tree}/adversarial.py"], env, cwd=tree)
        yield started
    finally:
        for battery in started.values():
            battery.stop()
        shutil.rmtree(tree, ignore_errors=True)


def test_every_attack_fails_as_this_user(batteries):
    battery = batteries["this_user"]
    _check(battery.result(), battery.secret)


@pytest.mark.skipif(os.geteuid() != 0, reason="already unprivileged: the test above ran as this user")
def test_every_attack_fails_as_an_unprivileged_user(batteries):
    assert "unprivileged" in batteries, ("the unprivileged run needs the system's Python with pytest and pluggy: "
                                         "apt-get install python3-pytest python3-pluggy")
    battery = batteries["unprivileged"]
    _check(battery.result(), battery.secret)
