"""The trusted side of assert- and pytest-style tests: runs the tests, never the program.

Assert-style tests run in the reward worker itself (:meth:`roll_rewards.sandbox.Sandbox.run_tests`
calls :func:`run_asserts` with :func:`proxies`). Pytest-style tests run here, started as
``python -m roll_rewards._test_runner pytest REQUEST_FD REPLY_FD`` with the tests on stdin, as a
separate process from the sandboxed program (pytest imports and collects in a process of its own). The program's names are
proxies here: calling ``add(1, 2)`` sends the arguments to the program and gets back the result as
plain data, so every comparison, ``assert`` and ``pytest.raises`` runs in this process, on values the
program cannot forge, against expected values it never sees. The program cannot reach this process,
its output or its exit status. The verdict goes to the parent on stdout as one JSON line:
``{"passed": k, "total": n}``.

Limits of the style, documented in the code reward: arguments and results must be plain data (no
objects, classes or generators cross), and in-place changes to arguments are not seen.
"""

import ast
import builtins
import json
import os
import sys
import tempfile
import types

from roll_rewards._protocol import Channel, ProtocolError, decode_value, encode_value


class RemoteError(Exception):
    """An exception raised by the program that has no built-in counterpart here."""


def program_exception(kind: str, message: str) -> Exception:
    """The exception a test sees for one the program raised: the built-in class of that name (so
    ``pytest.raises(ValueError)`` works), else :class:`RemoteError`."""
    cls = getattr(builtins, kind, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(message)
    return RemoteError(f"{kind}: {message}")


class Candidate:
    """The sandboxed program, seen through its channel. Each request is answered before ``deadline``
    or raises ``TimeoutError`` (None: no deadline of its own; this process is then killed at the
    run's deadline by the worker). :class:`roll_rewards.sandbox.Program` is this, in the worker."""

    def __init__(self, channel: Channel, deadline: float | None = None):
        self.channel, self.deadline = channel, deadline

    def request(self, message: dict) -> dict:
        self.channel.send(message, self.deadline)
        return self.channel.recv(self.deadline)

    def names(self) -> dict:
        names = self.request({"op": "names"}).get("names")
        if type(names) is not dict:
            raise ProtocolError("malformed names reply")
        return {str(k): v for k, v in names.items()}

    def reply(self, name: str, args, kwargs) -> dict:
        """The program's answer to one call: ``{"value": ...}`` or ``{"error": kind, "message": ...}``."""
        return self.request({"op": "call", "name": name, "args": encode_value(list(args)),
                             "kwargs": encode_value(dict(kwargs or {}))})

    def call(self, name: str, args, kwargs):
        """The call as a test sees it: the result, or the program's exception as the built-in of
        that name (a malformed result is a :class:`RemoteError`, never a built-in one)."""
        reply = self.reply(name, args, kwargs)
        if "error" in reply:
            raise program_exception(str(reply["error"]), str(reply.get("message", "")))
        try:
            return decode_value(reply["value"])
        except (ProtocolError, KeyError) as e:
            raise RemoteError(f"malformed result: {e}") from None


def proxies(names: dict, call) -> dict:
    """The program's top-level ``names`` (as its ``names`` reply gives them) for the tests: a
    function becomes a proxy that sends its arguments through ``call(name, args, kwargs)``, a
    constant its plain-data value. Built-ins are never shadowed."""
    found = {}
    for name, kind in names.items():
        if hasattr(builtins, name):
            continue
        if kind == "callable":
            found[name] = _proxy(name, call)
        elif type(kind) is dict and "value" in kind:
            found[name] = decode_value(kind["value"])
    return found


def _proxy(name: str, call):
    def remote(*args, **kwargs):
        return call(name, args, kwargs)

    remote.__name__ = remote.__qualname__ = name
    return remote


def run_asserts(tests: str, names: dict) -> tuple[int, int]:
    """Each top-level ``assert`` is one test; other statements (imports, helpers) run in order."""
    tree = ast.parse(tests)
    namespace = {"__name__": "__tests__", "__builtins__": builtins, **names}
    passed = total = 0
    for statement in tree.body:
        is_test = isinstance(statement, ast.Assert)
        total += is_test
        try:
            exec(compile(ast.Module([statement], []), "<tests>", "exec", optimize=0), namespace)  # asserts kept under -O
            passed += is_test
        except Exception:
            pass
    return passed, total


class _Outcomes:
    """A pytest plugin that counts each test's outcome from pytest's own reports, not its output."""

    def __init__(self):
        self.outcomes: dict[str, bool] = {}

    def pytest_collection_modifyitems(self, items):
        """Only tests the test file itself defines: ``from solution import *`` must not let the
        program add passing ``test_*`` functions of its own."""
        items[:] = [item for item in items
                    if getattr(getattr(item, "function", None), "__module__", None) == item.module.__name__]

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.outcomes[report.nodeid] = False
        elif report.when == "call":
            self.outcomes.setdefault(report.nodeid, True)


def run_pytest(tests: str, names: dict) -> tuple[int, int]:
    import pytest

    module = types.ModuleType("solution")
    module.__dict__.update(names)
    sys.modules["solution"] = module
    outcomes = _Outcomes()
    with tempfile.TemporaryDirectory(prefix="roll-tests-") as tmp:
        with open(os.path.join(tmp, "test_solution.py"), "w") as f:
            f.write(tests)
        pytest.main(["-q", "-p", "no:cacheprovider", "--no-header", "-o", "addopts=", "--rootdir", tmp, tmp],
                    plugins=[outcomes])
    return sum(outcomes.outcomes.values()), len(outcomes.outcomes)


def main() -> None:
    style, request_fd, reply_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tests = sys.stdin.read()
    verdict = sys.stdout
    sys.stdout = sys.stderr  # pytest's own output must not mix with the verdict line
    candidate = Candidate(Channel(reply_fd, request_fd))
    try:
        names = proxies(candidate.names(), candidate.call)
    except (EOFError, ProtocolError, OSError) as e:  # the program died, exited or sent garbage
        names = {}
        print(f"runner: no names from the program ({e})", file=sys.stderr)
    passed, total = (run_pytest if style == "pytest" else run_asserts)(tests, names)
    verdict.write(json.dumps({"passed": passed, "total": total}) + "\n")
    verdict.flush()


if __name__ == "__main__":
    main()
