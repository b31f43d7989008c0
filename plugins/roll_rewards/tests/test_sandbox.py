"""The sandbox's own contract: limits, refusal without isolation, the plain-data protocol, serving."""

import math
import time

import pytest

from roll_rewards import isolation
from roll_rewards._protocol import ProtocolError, decode_value, encode_value
from roll_rewards.sandbox import ProgramError, Sandbox, SandboxLimits, SandboxUnavailable, run_python

FAST = SandboxLimits(cpu_seconds=2, wall_seconds=4, memory_mb=256)


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(FAST)


def test_a_well_behaved_program_runs(sandbox):
    result = sandbox.run_script("print(input()[::-1])", stdin="abc")
    assert (result.status, result.stdout) == ("ok", "cba\n")
    assert run_python("print(6 * 7)").stdout == "42\n"


def test_the_probe_sees_the_confinement(sandbox):
    seen = sandbox.check()
    assert seen["uid"] != 0 and seen["pid"] <= 16 and seen["net"] in ([], ["lo"])
    assert set(seen["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONHASHSEED", "PWD"}


def test_limits_end_the_program_and_say_which(sandbox):
    start = time.monotonic()
    assert sandbox.run_script("while True: pass").status == "cpu_limit"
    assert sandbox.run_script("import time; time.sleep(60)").status == "timeout"
    assert sandbox.run_script("x = bytearray(1 << 31)").status == "memory_limit"
    flood = sandbox.run_script("while True: print('x' * 10000)")
    assert flood.status == "output_limit" and len(flood.stdout) <= FAST.max_output_bytes
    assert sandbox.run_script("open('f', 'wb').write(b'x' * (8 << 20))").status == "output_limit"  # file size
    assert time.monotonic() - start < 4 * (FAST.wall_seconds + 2)


def test_no_bubblewrap_means_no_sandbox(monkeypatch):
    monkeypatch.setattr(isolation.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        Sandbox(FAST)


def test_an_unreachable_interpreter_is_refused_with_what_to_do(tmp_path):
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    (hidden / "python3").write_text("")
    if isolation.sandbox_user() == __import__("os").geteuid():
        pytest.skip("as an unprivileged worker, the sandbox user owns the directory")
    with pytest.raises(SandboxUnavailable, match="cannot be run by uid 65534"):
        Sandbox(FAST, python=str(hidden / "python3"))


def test_unsafe_mode_warns_loudly(capsys):
    with pytest.warns(RuntimeWarning, match="WITHOUT kernel isolation"):
        unsafe = Sandbox(FAST, isolation="unsafe")
    assert "WITHOUT kernel isolation" in capsys.readouterr().err
    assert unsafe.run_script("print(1)").stdout == "1\n"
    with pytest.raises(ValueError, match="valid: 'bubblewrap', 'unsafe'"):
        Sandbox(FAST, isolation="docker")


def test_plain_data_round_trips_and_nothing_else_crosses():
    value = [1, -2.5, "s", None, True, (1, (2,)), {3, 4}, frozenset({5}), {"k": [1], (1, 2): b"\x00"},
             math.inf, b"bytes"]
    assert decode_value(encode_value(value)) == value
    assert math.isnan(decode_value(encode_value(math.nan)))

    class Sneaky(int):
        def __eq__(self, other):
            return True

    for bad in (Sneaky(1), object(), (x for x in ()), [Sneaky(2)], {"k": object()}):
        with pytest.raises(ProtocolError):
            encode_value(bad)
    nested = []
    for _ in range(100):
        nested = [nested]
    with pytest.raises(ProtocolError, match="deeply"):
        encode_value(nested)
    for forged in ({"$tuple": 1}, {"a": 1, "b": 2}, {"$eval": "1"}, {"$set": [[1]]}):
        with pytest.raises(ProtocolError):
            decode_value(forged)


def test_served_functions_return_plain_data_and_raise_program_errors(sandbox):
    program = "def add(a, b):\n    return a + b\ndef boom():\n    raise KeyError('x')\ndef obj():\n    return object()\n"
    with sandbox.serve(program) as served:
        assert served.call("add", [1, 2]) == 3
        assert served.call("add", [(1,), (2,)]) == (1, 2)
        with pytest.raises(ProgramError) as e:
            served.call("boom")
        assert e.value.kind == "KeyError"
        with pytest.raises(ProgramError) as e:
            served.call("obj")
        assert e.value.kind == "ProtocolError"
        with pytest.raises(ProgramError) as e:
            served.call("missing")
        assert e.value.kind == "KeyError"


def test_a_served_program_that_hangs_times_out_within_the_deadline(sandbox):
    start = time.monotonic()
    with sandbox.serve("import time\ndef f():\n    time.sleep(60)\n") as served:
        with pytest.raises(ProgramError) as e:
            served.call("f")
    assert e.value.kind == "timeout" and time.monotonic() - start < FAST.wall_seconds + 2


def test_assert_and_pytest_tests_run_outside_the_program(sandbox):
    program = "def add(a, b):\n    return a + b\n"
    tests = "import math\nassert add(1, 2) == 3\nassert math.isclose(add(0.1, 0.2), 0.3)\nassert add(1, 1) == 3"
    assert sandbox.run_tests(program, tests, "assert") == (2, 3)
    pytest_tests = ("from solution import add\nimport pytest\n"
                    "def test_ok():\n    assert add(1, 2) == 3\n"
                    "def test_raises():\n    with pytest.raises(TypeError):\n        add(1, 'a')\n"
                    "def test_wrong():\n    assert add(1, 1) == 3\n")
    assert sandbox.run_tests(program, pytest_tests, "pytest") == (2, 3)
    with pytest.raises(ValueError, match="style"):
        sandbox.run_tests(program, tests, "doctest")
