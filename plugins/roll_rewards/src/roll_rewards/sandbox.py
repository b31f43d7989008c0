"""A sandbox for model-written Python programs: a separate, confined, throwaway process.

Code rewards run programs that a policy wrote, at thousands per step, next to the training job and
its secrets. Each run gets:

* a separate process in its own session (the whole process group is killed afterwards);
* a fresh temporary working directory, deleted afterwards; writes anywhere else are refused;
* a clean environment: no variable of the parent (API keys, tokens) is passed on;
* limits on CPU seconds, wall seconds, address space, output file size, processes and open files;
* no network: a fresh network namespace where the kernel allows unprivileged user namespaces, and in
  every case an audit hook that refuses sockets, process creation, ``ctypes`` and signals to other
  processes (see ``_sandbox_child.py``).

A program that misbehaves ends with a status other than ``ok``; the caller scores it 0 and the run
goes on. This is defence in depth for Python programs, not a VM: for hostile multi-tenant use, run
the reward workers themselves in containers.

    result = run_python("print(input()[::-1])", stdin="abc", limits=SandboxLimits(wall_seconds=5))
    result.status, result.stdout      # ('ok', 'cba\\n')
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

CHILD = Path(__file__).with_name("_sandbox_child.py")


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_mb: int = 512
    file_size_mb: float = 4.0  # also caps stdout/stderr, which go to files
    max_processes: int = 8  # threads count too (RLIMIT_NPROC)
    max_output_bytes: int = 64 * 1024  # returned to the caller
    network_namespace: bool = True


@dataclass
class SandboxResult:
    status: str  # ok | error | timeout | cpu_limit | memory_limit | output_limit | killed
    returncode: int | None
    stdout: str
    stderr: str
    wall_seconds: float
    network_isolation: str = ""  # "namespace" or "audit-hook"
    files: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _clean_env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}


def _status(returncode: int | None, stderr: str, timed_out: bool) -> str:
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL) and "MemoryError" not in stderr:
        return "cpu_limit" if returncode == -signal.SIGXCPU else "killed"
    if returncode == -signal.SIGXFSZ or "File too large" in stderr:
        return "output_limit"  # Python ignores SIGXFSZ, so the write fails with EFBIG instead
    if "MemoryError" in stderr:
        return "memory_limit"
    return "error"


def _read(path: Path, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def run_sandboxed(files: dict[str, str], *, mode: str = "script", program: str = "main.py", stdin: str = "",
                  limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Write ``files`` into a fresh directory and run ``program`` (``mode="script"``) or pytest on the
    directory (``mode="pytest"``) under the sandbox. Never raises for anything the program does."""
    workdir = tempfile.mkdtemp(prefix="roll-sandbox-")
    try:
        for name, text in files.items():
            target = Path(workdir, name)
            if Path(workdir) not in target.resolve().parents:
                raise ValueError(f"sandbox file name escapes the working directory: {name!r}")
            target.write_text(text)
        spec = {**asdict(limits), "workdir": workdir, "mode": mode, "program": os.path.join(workdir, program)}
        out_path, err_path = Path(workdir, ".stdout"), Path(workdir, ".stderr")
        start = time.perf_counter()
        timed_out = False
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", str(CHILD), json.dumps(spec)], stdin=subprocess.PIPE, stdout=out,
                stderr=err, cwd=workdir, env=_clean_env(workdir), start_new_session=True,
            )
            try:
                proc.communicate(stdin.encode(), timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            except (BrokenPipeError, OSError):
                pass  # the program exited without reading its input
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the program and anything it started
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        wall = time.perf_counter() - start
        stderr = _read(err_path, limits.max_output_bytes)
        return SandboxResult(
            status=_status(proc.returncode, stderr, timed_out), returncode=proc.returncode,
            stdout=_read(out_path, limits.max_output_bytes), stderr=stderr, wall_seconds=wall,
            network_isolation=_read(Path(workdir, ".sandbox-network"), 64),
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_python(code: str, *, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run one Python program under the sandbox."""
    return run_sandboxed({"main.py": code}, stdin=stdin, limits=limits)
