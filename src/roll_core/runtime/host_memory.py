"""Freed host memory kept in the process, so a CPU worker's next step reuses it instead of faulting it in.

Why: torch allocates CPU tensors with ``malloc``. glibc serves requests above its mmap threshold
(32 MiB at most) with a fresh ``mmap`` and returns them with ``munmap`` when freed, and trims the
heap's free top back to the kernel; memory handed back is zero-filled page by page, on first touch,
the next time it is needed. A training pass on CPU frees its activations at the end of every step and
allocates them again in the next, so every step faults gigabytes back in: 0.3-1.2 million page faults
(1.1-4.9 GB) per update of the 95M model of ``benchmarks/large_model.py``, each zero-filled by the
kernel on the cores that compute. With mmap and trimming off, glibc keeps freed memory in its heap
and later allocations reuse it: no faults once the run has reached its peak, and updates 1.1-1.2x
faster on the 2-core machine of docs/benchmarks.md (``benchmarks/bench_host_memory.py``). The
process then holds its peak until it exits, as any caching allocator does.

Applied once per process by workers that compute on CPU (``runtime.reuse_freed_memory``); a worker
with devices leaves the allocator alone, since a GPU worker's host peak is mostly a checkpoint's
transient copy it should give back. Only glibc has these knobs (``mallopt``); elsewhere nothing
changes.
"""

from __future__ import annotations

import ctypes
from functools import cache

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1  # the largest value mallopt takes: the heap's free top is never handed back


@cache
def keep_freed_memory() -> bool:
    """Stop glibc from returning freed memory to the kernel, for this process. Returns whether it
    did (False where the C library is not glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    # mallopt returns 1 on success; with mmap off every allocation comes from the heap, which glibc
    # still extends with mmap when brk cannot grow, so large requests keep working
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))


def _glibc():
    """The C library this process already links, where it is glibc. (The process's own symbols: no
    library search, which would run ``ldconfig`` in every worker at start-up.)"""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only; musl and macOS's libc lack it  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc
