"""Kernel-enforced confinement for sandboxed programs: bubblewrap, seccomp, cgroups, a non-root uid.

Every barrier here is enforced by the kernel, not by the confined Python process, which may do
anything to itself:

* **bubblewrap** (Debian's ``bubblewrap``) puts the program in new user, PID, network, IPC, UTS and
  cgroup namespaces. It sees a read-only ``/usr`` and interpreter, a fresh ``/proc`` holding only its
  own processes, a minimal ``/dev``, a private ``/dev/shm``, and one writable tmpfs of
  ``disk_mb`` as its working directory. There is no network but its own loopback, no host socket,
  no environment variable of the worker, and no way to create further user namespaces. When the
  sandbox's first process dies the kernel kills every process it started, new sessions included.
* **A non-root uid.** Inside, the program is uid 65534. When the worker runs as root, bubblewrap is
  started as uid 65534 too (``setpriv``), so the program is not root outside either: it cannot read
  root's files, signal root's processes, and ``RLIMIT_NPROC`` binds it.
* **seccomp** (``libseccomp``, when installed): system calls a test program never needs (ptrace,
  ``process_vm_*``, keyrings, bpf, perf, io_uring, mounts, namespaces, kernel modules, device nodes
  and FIFOs) fail with EPERM.
* **cgroups** (when the worker may create them, which root may): a pids limit and a memory limit for
  the whole tree, tmpfs pages included, and a reliable kill of every member.

``Bubblewrap.check()`` runs a probe and raises :class:`SandboxUnavailable` with what to install or
enable; the code reward calls it before scoring anything, so isolation never silently degrades.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import stat
import sys
import time
import uuid
from functools import lru_cache
from pathlib import Path

NOBODY = 65534


class SandboxUnavailable(RuntimeError):
    """Kernel isolation cannot be set up on this machine; the message says what to install or enable."""


# ---------------------------------------------------------------------------------------------------
# seccomp
# ---------------------------------------------------------------------------------------------------

DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsmount", "fspick",
    "mount_setattr", "unshare", "setns", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "reboot", "swapon", "swapoff", "syslog", "acct", "quotactl", "name_to_handle_at",
    "open_by_handle_at", "fanotify_init", "mknod", "mknodat", "personality",
)
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_ACT_ERRNO = 0x00050000


@lru_cache(maxsize=1)
def seccomp_program() -> bytes | None:
    """A BPF filter (allow all but ``DENIED_SYSCALLS``, which get EPERM) built by libseccomp, or None."""
    name = ctypes.util.find_library("seccomp")
    if not name:
        return None
    lib = ctypes.CDLL(name)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        return None
    try:
        for syscall in DENIED_SYSCALLS:
            number = lib.seccomp_syscall_resolve_name(syscall.encode())
            if number >= 0 and lib.seccomp_rule_add(ctx, _SCMP_ACT_ERRNO | errno.EPERM, number, 0) != 0:
                return None
        fd = os.memfd_create("roll-seccomp")
        try:
            if lib.seccomp_export_bpf(ctx, fd) != 0:
                return None
            os.lseek(fd, 0, os.SEEK_SET)
            return os.read(fd, 1 << 20)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


# ---------------------------------------------------------------------------------------------------
# cgroups
# ---------------------------------------------------------------------------------------------------

def _own_cgroups() -> dict[str, str]:
    """controller -> this process's cgroup path, from /proc/self/cgroup (v1 lines)."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            paths[controller] = path
    return paths


class Cgroup:
    """One sandbox's cgroup(s): pids and memory limits, v2 or v1, created only where permitted."""

    def __init__(self, dirs: list[Path]):
        self.dirs = dirs

    @classmethod
    def create(cls, max_processes: int, memory_bytes: int) -> Cgroup | None:
        if os.geteuid() != 0:
            return None
        name = f"roll-sandbox/{uuid.uuid4().hex}"
        root = Path("/sys/fs/cgroup")
        dirs: list[Path] = []
        try:
            if (root / "cgroup.controllers").exists():  # unified hierarchy (v2)
                controllers = (root / "cgroup.controllers").read_text().split()
                if not {"pids", "memory"} <= set(controllers):
                    return None
                parent = root / "roll-sandbox"
                parent.mkdir(exist_ok=True)
                for level in (root, parent):
                    (level / "cgroup.subtree_control").write_text("+pids +memory")
                leaf = root / name
                leaf.mkdir()
                dirs.append(leaf)
                (leaf / "pids.max").write_text(str(max_processes))
                (leaf / "memory.max").write_text(str(memory_bytes))
                (leaf / "memory.swap.max").write_text("0")
            elif (root / "pids").is_dir() and (root / "memory").is_dir():  # v1, nested in the worker's own
                own = _own_cgroups()
                for controller in ("pids", "memory"):
                    leaf = root / controller / own.get(controller, "/").lstrip("/") / name
                    leaf.mkdir(parents=True)
                    dirs.append(leaf)
                (dirs[0] / "pids.max").write_text(str(max_processes))
                (dirs[1] / "memory.limit_in_bytes").write_text(str(memory_bytes))
            else:
                return None
        except OSError:
            cls(dirs).remove()
            return None
        return cls(dirs)

    def enter_command(self, command: list[str]) -> list[str]:
        """``command`` started from inside the cgroup(s), before it can start anything itself."""
        joins = " && ".join(f"echo $$ > '{d}/cgroup.procs'" for d in self.dirs)
        return ["/bin/sh", "-c", f'{joins} && exec "$@"', "sh", *command]

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.dirs[0] / "cgroup.procs").read_text().split()]
        except (OSError, IndexError, ValueError):
            return []

    def remove(self) -> None:
        """Kill whatever is left in the cgroup, then remove it."""
        for _ in range(50):
            members = self.pids()
            for pid in members:
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            try:
                for d in self.dirs:
                    d.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)  # members still exiting


# ---------------------------------------------------------------------------------------------------
# bubblewrap
# ---------------------------------------------------------------------------------------------------

def _reachable_by(path: Path, uid: int) -> bool:
    """Whether ``uid`` (as "other", or as owner) can traverse to and execute ``path``."""
    try:
        for part in [*reversed(path.parents), path]:
            info = part.stat()
            need = stat.S_IXOTH if info.st_uid != uid else stat.S_IXUSR
            if not info.st_mode & need:
                return False
        return True
    except OSError:
        return False


def sandbox_user() -> int:
    """The host uid the sandboxed program runs as: 65534 when the worker is root, else the worker's own."""
    return NOBODY if os.geteuid() == 0 else os.geteuid()


def find_interpreter(python: str | None) -> Path:
    """The Python that runs programs: ``python`` if given, else the worker's own base interpreter when
    the sandbox user can reach it, else the system's ``python3``."""
    user = sandbox_user()
    if python:
        path = Path(python)
        if not path.is_absolute():
            path = Path(shutil.which(python) or python)
        if not _reachable_by(path.resolve(), user):
            raise SandboxUnavailable(f"code sandbox: interpreter {python!r} cannot be run by uid {user} (the "
                                     "sandbox user); choose one outside root's home, e.g. /usr/bin/python3")
        return path.resolve()
    candidates = [getattr(sys, "_base_executable", sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"]
    for candidate in candidates:
        path = Path(candidate).resolve()
        if path.exists() and _reachable_by(path, user):
            return path
    raise SandboxUnavailable(f"code sandbox: no Python interpreter that uid {user} (the sandbox user) can run; "
                             "install the system's python3 (apt-get install python3) or set the reward's "
                             "`python` option")


class Bubblewrap:
    """Builds the command line that runs ``argv`` confined; see the module docstring for what holds."""

    name = "bubblewrap"

    def __init__(self, python: str | None = None):
        self.bwrap = shutil.which("bwrap")
        if not self.bwrap:
            raise SandboxUnavailable(
                "code sandbox: bubblewrap is not installed. Install it (Debian/Ubuntu: `apt-get install "
                "bubblewrap`; Fedora: `dnf install bubblewrap`), or set the reward option "
                "`isolation: unsafe` for trusted local experiments only")
        self.python = find_interpreter(python)
        self.drop_to_nobody = os.geteuid() == 0
        if self.drop_to_nobody and not shutil.which("setpriv"):
            raise SandboxUnavailable("code sandbox: running as root needs `setpriv` (util-linux) to start the "
                                     "sandbox as uid 65534")
        self.seccomp = seccomp_program()

    def layers(self) -> list[str]:
        return ["bubblewrap namespaces", f"uid {sandbox_user()}"] + (["seccomp"] if self.seccomp else [])

    def _binds(self) -> list[str]:
        args = ["--ro-bind", "/usr", "/usr"]
        for top in ("bin", "sbin", "lib", "lib64", "lib32"):
            path = Path("/", top)
            if path.is_symlink():
                args += ["--symlink", os.readlink(path), str(path)]
            elif path.is_dir():
                args += ["--ro-bind", str(path), str(path)]
        prefix = self.python.parent.parent
        if not str(prefix).startswith("/usr/") and str(prefix) != "/usr":
            args += ["--ro-bind", str(prefix), str(prefix)]
        return args + ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]

    def command(self, argv: list[str], *, disk_bytes: int, seccomp_fd: int | None) -> list[str]:
        """``argv`` (its first item the interpreter's path is prepended to) under bubblewrap."""
        cmd = [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
               "--new-session", "--cap-drop", "ALL", "--uid", str(NOBODY), "--gid", str(NOBODY),
               *self._binds(), "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/dev/shm",
               "--size", str(disk_bytes), "--tmpfs", "/tmp", "--chdir", "/tmp", "--hostname", "sandbox",
               "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
               "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONHASHSEED", "0"]
        if seccomp_fd is not None:
            cmd += ["--seccomp", str(seccomp_fd)]
        cmd += ["--", str(self.python), *argv]
        if self.drop_to_nobody:
            cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
                   "--bounding-set=-all", "--", *cmd]
        return cmd


class Unsafe:
    """No kernel isolation: a plain child process with rlimits and a clean environment. For trusted
    local experiments only; the code reward warns on every run that uses it."""

    name = "unsafe"

    def __init__(self, python: str | None = None):
        self.python = Path(python or sys.executable)
        self.seccomp = None

    def layers(self) -> list[str]:
        return ["none (unsafe)"]

    def command(self, argv: list[str], *, disk_bytes: int, seccomp_fd: int | None) -> list[str]:
        return [str(self.python), *argv]
