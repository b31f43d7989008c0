"""The code sandbox against hostile programs: each is contained, reported, scored 0, and the test
process (standing in for the reward worker) survives and keeps its files and secrets."""

import os
import textwrap
import time
import uuid

import pytest

from roll_core.rewards import RewardInput
from roll_rewards.code import CodeReward, extract_code
from roll_rewards.sandbox import SandboxLimits, run_python

FAST = SandboxLimits(cpu_seconds=2, wall_seconds=6, memory_mb=256)


def run(code, **kw):
    return run_python(textwrap.dedent(code), limits=FAST, **kw)


def test_a_well_behaved_program_runs():
    result = run("print(input()[::-1])", stdin="abc")
    assert result.status == "ok" and result.stdout == "cba\n"


def test_infinite_loop_hits_the_cpu_limit():
    start = time.perf_counter()
    result = run("while True: pass")
    assert result.status == "cpu_limit" and time.perf_counter() - start < FAST.wall_seconds


def test_sleeping_forever_hits_the_wall_limit():
    result = run_python("import time; time.sleep(60)", limits=SandboxLimits(wall_seconds=1.5))
    assert result.status == "timeout" and result.wall_seconds < 5


def test_fork_bomb_is_refused():
    result = run("""
        import os
        while True:
            os.fork()
    """)
    assert result.status == "error" and "not allowed" in result.stderr


def test_subprocess_is_refused():
    result = run("import subprocess; subprocess.run(['echo', 'hi'])")
    assert result.status == "error" and "not allowed" in result.stderr


def test_memory_hog_is_stopped():
    result = run("x = bytearray(2 ** 31)")
    assert result.status == "memory_limit"


def test_huge_output_is_capped():
    result = run("while True: print('x' * 10000)")
    assert result.status in ("output_limit", "timeout", "cpu_limit")
    assert len(result.stdout) <= FAST.max_output_bytes


def test_writing_outside_its_directory_is_refused():
    target = f"/tmp/roll-escape-{uuid.uuid4().hex}"
    result = run(f"open({target!r}, 'w').write('pwned')")
    assert result.status == "error" and "outside the working directory" in result.stderr
    assert not os.path.exists(target)
    # inside its own throwaway directory it may write, and the directory is gone afterwards
    result = run("open('scratch.txt', 'w').write('ok'); import os; print(os.getcwd())")
    assert result.status == "ok" and not os.path.exists(result.stdout.strip())


def test_the_parents_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("ROLL_TEST_SECRET", "hunter2")
    result = run("import os; print(os.environ.get('ROLL_TEST_SECRET')); print(sorted(os.environ))")
    assert result.status == "ok" and "hunter2" not in result.stdout
    assert result.stdout.splitlines()[0] == "None"


@pytest.mark.parametrize("namespace", [True, False], ids=["netns", "audit-hook-only"])
def test_network_connections_fail(namespace):
    code = "import socket; socket.create_connection(('1.1.1.1', 80), timeout=2); print('connected')"
    result = run_python(code, limits=SandboxLimits(cpu_seconds=2, wall_seconds=6, network_namespace=namespace))
    assert result.status == "error" and "connected" not in result.stdout


def test_ctypes_cannot_bypass_the_policy():
    result = run("import ctypes; ctypes.CDLL(None).kill(__import__('os').getppid(), 9)")
    assert result.status == "error"


def test_killing_its_parent_is_refused():
    result = run("import os, signal; os.kill(os.getppid(), signal.SIGKILL)")
    assert result.status == "error" and "signalling other processes" in result.stderr
    result = run("import os, signal; os.killpg(0, signal.SIGKILL)")  # its own group only: allowed, ends itself
    assert result.status in ("killed", "error")


def test_hostile_programs_score_zero_and_the_reward_goes_on():
    reward = CodeReward(cpu_seconds=2, wall_seconds=6, memory_mb=256)
    truth = {"style": "stdio", "cases": [{"input": "2 3\n", "output": "5\n"}]}
    hostile = ["while True: pass", "import os\nwhile True: os.fork()", "x = bytearray(2 ** 31)",
               "import os, signal; os.kill(os.getppid(), signal.SIGKILL)"]
    for program in hostile:
        assert reward.score(RewardInput("", f"```python\n{program}\n```", truth)) == 0.0
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert reward.score(RewardInput("", good, truth)) == 1.0


def test_extract_code_takes_the_last_fenced_block():
    assert extract_code("first\n```python\nx = 1\n```\nthen\n```\ny = 2\n```") == "y = 2\n"
    assert extract_code("print(1)") == "print(1)"
