"""Runs inside the sandbox process: confine itself, then run the untrusted program.

Executed as ``python -I _sandbox_child.py SPEC_JSON`` by :mod:`roll_rewards.sandbox`, never imported.
Only the standard library is used before the policy is in place. The order matters:

1. new user + network namespaces when the kernel allows it (no network interface but a downed
   loopback: connections fail at the kernel, whatever the program does);
2. resource limits (CPU seconds, address space, file size, processes, open files, no core dumps);
3. a Python audit hook that refuses sockets, process creation, signals to other processes,
   ``ctypes`` and any write outside the working directory (audit hooks cannot be removed);
4. the program itself, as ``__main__`` (or pytest on the working directory).
"""

import ctypes
import json
import os
import resource
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


def enter_namespaces() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0
    except Exception:
        return False


def set_limits(spec: dict) -> None:
    cpu = int(spec["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    memory = int(spec["memory_mb"]) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    size = int(spec["file_size_mb"] * 2**20)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["max_processes"], spec["max_processes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def install_policy(workdir: str) -> None:
    root = os.path.realpath(workdir)
    me = os.getpid()
    denied_prefixes = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn",
                       "os.fork", "os.forkpty", "pty.", "os.system", "os.startfile", "webbrowser.",
                       "ftplib.", "http.client.", "smtplib.", "urllib.Request", "os.setuid", "os.chroot")
    path_events = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod",
                   "os.chown", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}

    def inside(path) -> bool:
        try:
            if isinstance(path, int):
                return True  # an already-open descriptor: its open was checked
            real = os.path.realpath(os.fsdecode(path))
        except Exception:
            return False
        return real == root or real.startswith(root + os.sep) or real == os.devnull

    def hook(event: str, args: tuple) -> None:
        if event.startswith(denied_prefixes):
            raise PermissionError(f"sandbox: '{event}' is not allowed")
        if event in ("os.kill", "os.killpg", "signal.pthread_kill"):
            if args and args[0] not in (me, 0):
                raise PermissionError("sandbox: signalling other processes is not allowed")
        elif event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
            if writing and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing outside the working directory ({path!r})")
        elif event in path_events:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    raise PermissionError(f"sandbox: '{event}' outside the working directory")

    sys.addaudithook(hook)


def main() -> None:
    spec = json.loads(sys.argv[1])
    workdir = spec["workdir"]
    isolated = enter_namespaces() if spec["network_namespace"] else False
    with open(os.path.join(workdir, ".sandbox-network"), "w") as f:
        f.write("namespace" if isolated else "audit-hook")
    os.chdir(workdir)
    if spec["mode"] == "pytest":
        import pytest  # imported before the policy: plugins load modules and create temp dirs

        set_limits(spec)
        install_policy(workdir)
        sys.argv = ["pytest"]
        code = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--no-header", workdir])
        sys.exit(int(code))
    set_limits(spec)
    install_policy(workdir)
    sys.argv = [spec["program"]]
    sys.path.insert(0, workdir)
    import runpy

    runpy.run_path(spec["program"], run_name="__main__")


main()
