"""Running model-written Python programs so that they cannot cheat, escape or hurt the worker.

A policy under RL optimises what the grader really checks, so the grader is built as if every
program were an attacker:

* **Confinement is the kernel's** (:mod:`roll_rewards.isolation`): bubblewrap namespaces, a non-root
  uid, seccomp, cgroups and rlimits that hold for every process the program starts. If it cannot be
  set up, :class:`Sandbox` refuses to start (:class:`SandboxUnavailable`); ``isolation="unsafe"``
  exists for trusted local experiments and warns on every run.
* **The verdict is the parent's.** Tests and expected outputs never enter the sandbox. The program's
  stdout (stdio tests) or its function results (function, assert and pytest tests, as plain data:
  see ``_protocol``) cross back and are compared outside, by the worker or by a separate trusted
  test-runner process. The exit status, the program's own prints about tests, an object with a
  rigged ``__eq__``: none of these can make a test pass.
* **Output travels through pipes the parent holds**, read with a size bound and under the same
  wall-clock deadline as everything else. Nothing is read back from files the program can replace.

Three ways to run a program:

    sandbox = Sandbox(SandboxLimits(wall_seconds=5))
    sandbox.run_script("print(input()[::-1])", stdin="abc").stdout        # 'cba\\n'
    with sandbox.serve("def add(a, b): return a + b") as program:
        program.call("add", [1, 2])                                        # 3
    sandbox.run_tests("def add(a, b): return a + b", "assert add(1, 2) == 3", style="assert")  # (1, 1)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from roll_rewards._protocol import Channel, ProtocolError, decode_value
from roll_rewards._test_runner import Candidate, proxies, run_asserts
from roll_rewards.isolation import Bubblewrap, Cgroup, SandboxUnavailable, Unsafe

__all__ = ["ProgramError", "Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_python"]

_HERE = Path(__file__).parent
MAX_PROGRAM_BYTES = 1 << 20




@dataclass(frozen=True)
class SandboxLimits:
    """Limits that hold for the program and everything it starts."""

    cpu_seconds: int = 5
    wall_seconds: float = 10.0  # one deadline for the whole run: start, every call, every read
    memory_mb: int = 512  # address space per process (RLIMIT_AS), and the whole tree's memory (cgroup)
    file_size_mb: float = 4.0  # largest file it may write
    disk_mb: int = 64  # its writable tmpfs working directory
    max_processes: int = 16  # processes and threads together
    max_open_files: int = 64
    max_output_bytes: int = 64 * 1024  # stdout and stderr each; beyond it the program is stopped


@dataclass
class SandboxResult:
    status: str  # ok | error | timeout | cpu_limit | memory_limit | output_limit | killed
    returncode: int | None
    stdout: str
    stderr: str
    wall_seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class ProgramError(Exception):
    """A call into a served program did not return a plain-data value (it raised, died, timed out or
    answered with something else). ``kind`` is the program's exception name or the failure."""

    def __init__(self, kind: str, message: str = ""):
        super().__init__(f"{kind}: {message}" if message else kind)
        self.kind = kind


def _harness_source() -> str:
    return (_HERE / "_protocol.py").read_text() + "\n" + (_HERE / "_harness.py").read_text()


_HARNESS = _harness_source()


class _Drain(threading.Thread):
    """Reads one of the program's output pipes to its end, keeping at most ``limit`` bytes."""

    def __init__(self, pipe, limit: int, on_overflow):
        super().__init__(daemon=True)
        self.pipe, self.limit, self.on_overflow = pipe, limit, on_overflow
        self.data = bytearray()
        self.overflow = False
        self.start()

    def run(self) -> None:
        try:
            while chunk := self.pipe.read1(1 << 16):
                if len(self.data) + len(chunk) > self.limit:
                    self.data += chunk[: self.limit - len(self.data)]
                    self.overflow = True
                    self.on_overflow()
                    return
                self.data += chunk
        except (OSError, ValueError):
            pass

    def text(self) -> str:
        self.join(timeout=2.0)
        return bytes(self.data).decode("utf-8", errors="replace")


def _feed(fd_or_pipe, data: bytes) -> None:
    """Writes ``data`` then closes, from a thread, so a program that never reads cannot block us."""

    def write() -> None:
        try:
            if isinstance(fd_or_pipe, int):
                view = memoryview(data)
                while view:
                    view = view[os.write(fd_or_pipe, view):]
            else:
                fd_or_pipe.write(data)
        except OSError:
            pass  # the program exited or closed its end without reading
        finally:
            try:
                os.close(fd_or_pipe) if isinstance(fd_or_pipe, int) else fd_or_pipe.close()
            except OSError:
                pass

    threading.Thread(target=write, daemon=True).start()


class _Confined:
    """One confined harness process running ``program``: started, drained, stopped, classified."""

    def __init__(self, sandbox: Sandbox, mode: str, program: str, stdin: str = "", rpc_fds: tuple[int, int] = (-1, -1)):
        limits, confine = sandbox.limits, sandbox.confinement
        source = program.encode("utf-8", errors="replace")
        if len(source) > MAX_PROGRAM_BYTES:
            raise ProgramError("too_large", f"program of {len(source)} bytes")
        self.start = time.monotonic()
        self.deadline = self.start + limits.wall_seconds
        self.timed_out = False
        program_r, program_w = os.pipe()
        seccomp_fd = None
        if confine.seccomp:
            seccomp_fd = os.memfd_create("roll-seccomp", 0)
            os.write(seccomp_fd, confine.seccomp)
            os.lseek(seccomp_fd, 0, os.SEEK_SET)
        harness_limits = {k: v for k, v in asdict(limits).items() if k in (
            "cpu_seconds", "memory_mb", "file_size_mb", "max_processes", "max_open_files")}
        argv = ["-I", "-S", "-B", "-c", _HARNESS, mode, str(program_r), *map(str, rpc_fds), json.dumps(harness_limits)]
        cmd = confine.command(argv, disk_bytes=limits.disk_mb << 20, seccomp_fd=seccomp_fd)
        self.cgroup = None
        if isinstance(confine, Bubblewrap):
            self.cgroup = Cgroup.create(limits.max_processes + 4, (limits.memory_mb + limits.disk_mb) << 20)
            if self.cgroup:
                cmd = self.cgroup.enter_command(cmd)
        # Bubblewrap: the sandbox's first process heads a PID namespace; unsafe: a session of its own.
        self.in_namespace = isinstance(confine, Bubblewrap)
        self.workdir = None if self.in_namespace else tempfile.mkdtemp(prefix="roll-sandbox-")
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
               "HOME": self.workdir or "/", "TMPDIR": self.workdir or "/tmp"}
        fds = tuple(fd for fd in (program_r, seccomp_fd, *rpc_fds) if fd is not None and fd >= 0)
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         pass_fds=fds, env=env, cwd=self.workdir or "/", start_new_session=True)
        except BaseException:
            os.close(program_w)
            self._cleanup()
            raise
        finally:
            for fd in (program_r, seccomp_fd):
                if fd is not None:
                    os.close(fd)
        _feed(program_w, source)
        _feed(self.proc.stdin, stdin.encode("utf-8", errors="replace"))
        self.stdout = _Drain(self.proc.stdout, limits.max_output_bytes, self.kill)
        self.stderr = _Drain(self.proc.stderr, limits.max_output_bytes, self.kill)

    def left(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)

    def wait(self) -> None:
        try:
            self.proc.wait(timeout=self.left())
        except subprocess.TimeoutExpired:
            self.timed_out = True
        self.kill()

    def kill(self) -> None:
        """The program and everything it started: with bubblewrap, killing the sandbox's outer process
        kills its PID namespace (``--die-with-parent``); the cgroup catches anything else."""
        try:
            if self.in_namespace:
                os.kill(self.proc.pid, signal.SIGKILL)
            else:
                os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def finish(self) -> SandboxResult:
        self.kill()
        self.proc.wait()
        stdout, stderr = self.stdout.text(), self.stderr.text()
        self._cleanup()
        return SandboxResult(self._status(stderr), self.proc.returncode, stdout, stderr,
                             time.monotonic() - self.start)

    def _cleanup(self) -> None:
        if self.cgroup:
            self.cgroup.remove()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _status(self, stderr: str) -> str:
        code = self.proc.returncode
        if self.timed_out:
            return "timeout"
        if self.stdout.overflow or self.stderr.overflow:
            return "output_limit"
        if code == 0:
            return "ok"
        if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
            return "cpu_limit"
        if "MemoryError" in stderr:
            return "memory_limit"
        if code in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or "File too large" in stderr:
            return "output_limit"
        if code in (-signal.SIGKILL, 128 + signal.SIGKILL):
            return "killed"
        return "error"


class Program(Candidate):
    """A program served in the sandbox (see :meth:`Sandbox.serve`), under the run's deadline. Its
    ``call`` returns plain data or raises :class:`ProgramError`; ``test_call`` is the call as a test
    sees it (the program's exception as the built-in of that name)."""

    def __init__(self, confined: _Confined, channel: Channel):
        super().__init__(channel, confined.deadline)
        self.confined = confined

    def request(self, message: dict) -> dict:
        try:
            return super().request(message)
        except TimeoutError:
            self.confined.timed_out = True
            raise ProgramError("timeout") from None
        except (EOFError, BrokenPipeError):
            raise ProgramError("exited", "the program ended before answering") from None
        except (ProtocolError, OSError) as e:
            raise ProgramError("protocol", str(e)) from None

    def names(self) -> dict:
        """The program's top-level functions (``"callable"``) and plain-data constants (``{"value"}``)."""
        try:
            return super().names()
        except ProtocolError as e:
            raise ProgramError("protocol", str(e)) from None

    def call(self, name: str, args: list | tuple = (), kwargs: dict | None = None):
        reply = self.reply(name, args, kwargs)
        if "error" in reply:
            raise ProgramError(str(reply["error"]), str(reply.get("message", ""))[:500])
        try:
            return decode_value(reply["value"])
        except (ProtocolError, KeyError) as e:
            raise ProgramError("protocol", str(e)) from None

    test_call = Candidate.call


class Sandbox:
    """Runs programs under ``limits``, confined by ``isolation`` ("bubblewrap", the default, or
    "unsafe"); checks at construction that the confinement really holds, or raises
    :class:`SandboxUnavailable` saying what to install or enable."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), isolation: str = "bubblewrap",
                 python: str | None = None):
        self.limits = limits
        if isolation == "bubblewrap":
            self.confinement = Bubblewrap(python)
        elif isolation == "unsafe":
            self.confinement = Unsafe(python)
            message = ("code sandbox: isolation=unsafe: model-written programs run WITHOUT kernel isolation, "
                       "as this user, with the network and the filesystem reachable. Use it only for trusted "
                       "local experiments; install bubblewrap for anything else.")
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            print(f"warning: {message}", file=sys.stderr, flush=True)
        else:
            raise ValueError(f"code sandbox: unknown isolation {isolation!r}; valid: 'bubblewrap', 'unsafe'")
        self.check()

    def check(self) -> dict:
        """Runs a probe and verifies the confinement it reports; returns what the probe saw."""
        probe = ("import json, os, socket\n"
                 "print(json.dumps({'uid': os.getuid(), 'pid': os.getpid(),"
                 " 'net': sorted(n for _, n in socket.if_nameindex()), 'env': sorted(os.environ)}))")
        result = self.run_script(probe)
        try:
            seen = json.loads(result.stdout)
        except ValueError:
            seen = None
        if not result.ok or seen is None:
            raise SandboxUnavailable(
                f"code sandbox: {self.confinement.name} could not run a probe program (status {result.status}): "
                f"{result.stderr.strip()[-600:]}\nUsual causes: unprivileged user namespaces are disabled "
                "(`sysctl kernel.unprivileged_userns_clone=1`; on Ubuntu 24.04+ AppArmor restricts them: "
                "`sysctl kernel.apparmor_restrict_unprivileged_userns=0` or an AppArmor profile for bwrap), or "
                "a container without permission to create namespaces.")
        if isinstance(self.confinement, Bubblewrap):
            problems = [what for what, bad in (("runs as uid 0", seen["uid"] == 0),
                                               ("shares the PID namespace", seen["pid"] > 16),
                                               ("has network interfaces", seen["net"] not in ([], ["lo"])))
                        if bad]
            if problems:
                raise SandboxUnavailable(f"code sandbox: the probe {', '.join(problems)}; refusing to run programs")
        return seen

    def run_script(self, program: str, stdin: str = "") -> SandboxResult:
        """Runs ``program`` as ``__main__`` with ``stdin``; returns its bounded output and status."""
        confined = _Confined(self, "script", program, stdin)
        confined.wait()
        return confined.finish()

    @contextmanager
    def serve(self, program: str):
        """Runs ``program`` as the module ``solution`` and yields a :class:`Program` whose ``call``
        invokes its functions. The deadline covers the whole ``with`` block."""
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        try:
            confined = _Confined(self, "serve", program, rpc_fds=(request_r, reply_w))
        finally:
            os.close(request_r)
            os.close(reply_w)
        try:
            yield Program(confined, Channel(reply_r, request_w))
        finally:
            os.close(reply_r)
            os.close(request_w)
            confined.finish()

    def run_tests(self, program: str, tests: str, style: str) -> tuple[int, int]:
        """Assert- or pytest-style ``tests`` against the served ``program``; returns (passed, total).
        The tests never enter the sandbox: assert tests run here, in the worker, pytest tests in a
        separate trusted process; both see the program's functions as proxies returning plain data."""
        if style == "assert":
            with self.serve(program) as served:
                try:
                    names = served.names()
                except ProgramError:  # it exited, crashed or sent garbage before answering
                    names = {}
                return run_asserts(tests, proxies(names, served.test_call))
        if style != "pytest":
            raise ValueError(f"run_tests: style must be 'assert' or 'pytest', got {style!r}")
        with self.serve(program) as served:
            runner = _start_runner(style, tests, served.channel.write_fd, served.channel.read_fd)
            verdict = _Drain(runner.stdout, 1 << 16, lambda: None)
            noise = _Drain(runner.stderr, 1 << 16, lambda: None)
            try:
                runner.wait(timeout=served.confined.left())
            except subprocess.TimeoutExpired:
                served.confined.timed_out = True
            finally:
                try:
                    os.killpg(runner.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                runner.wait()
        noise.text()
        try:
            outcome = json.loads(verdict.text())
            return int(outcome["passed"]), int(outcome["total"])
        except (ValueError, KeyError, TypeError):
            return 0, 0



def _start_runner(style: str, tests: str, request_w: int, reply_r: int) -> subprocess.Popen:
    """The trusted test runner: the worker's own interpreter (it needs pytest), a clean environment,
    its own session. It runs the dataset's tests, never the program."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONPATH": str(_HERE.parent),
           "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "HOME": tempfile.gettempdir()}
    runner = subprocess.Popen(
        [sys.executable, "-s", "-m", "roll_rewards._test_runner", style, str(request_w), str(reply_r)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(request_w, reply_r),
        env=env, cwd=tempfile.gettempdir(), start_new_session=True)
    _feed(runner.stdin, tests.encode())
    return runner


_DEFAULT: dict[SandboxLimits, Sandbox] = {}


def run_python(code: str, *, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Runs one program as a script in a (cached, checked) bubblewrap sandbox."""
    if limits not in _DEFAULT:
        _DEFAULT[limits] = Sandbox(limits)
    return _DEFAULT[limits].run_script(code, stdin)
