"""Whether other processes already keep this machine's cores busy, and the thread count that suits.

Why: a worker's intra-op threads (``torch_threads``) form one OpenMP team that meets at a barrier
after every parallel operation. When another process keeps one of the team's cores busy, the
scheduler runs the team's thread there for only part of each time slice, so every barrier waits
for it, and the waiting threads spin on the other cores meanwhile. Measured on 2 cores with one
busy process beside the quickstart (``benchmarks/vs_trl.py --load 1``, docs/benchmarks.md): 2 threads
per process made the step 3.9x slower (TRL's 3.1x), while 1 thread ran within 10% of its idle speed
and beat 2 threads by 2.6x. ``roll run`` measures the other processes' share of the CPU for a tenth
of a second before any worker starts and says which ``torch_threads`` fits; it changes nothing itself,
since the thread count also decides the numerics and the speed of an idle machine.

Linux only (``/proc/stat``); elsewhere nothing is measured.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

STAT = Path("/proc/stat")


def _cpu_times() -> tuple[int, int] | None:
    """``(busy, total)`` jiffies of all CPUs since boot, or None where ``/proc/stat`` is missing."""
    try:
        fields = STAT.read_text().splitlines()[0].split()
    except OSError:
        return None
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def busy_cores(sample_s: float = 0.1) -> float | None:
    """Cores kept busy over the next ``sample_s`` seconds, by every process but a sleeping caller;
    None where it cannot be measured."""
    before = _cpu_times()
    if before is None:
        return None
    time.sleep(sample_s)
    after = _cpu_times()
    if after is None or after[1] <= before[1]:
        return None
    cores = os.cpu_count() or 1
    return cores * (after[0] - before[0]) / (after[1] - before[1])


def fitting_threads(threads: int, busy: float, cores: int) -> int | None:
    """The thread count to suggest when ``threads`` per worker do not fit beside ``busy`` cores of
    other work on ``cores``, else None. The free cores round to the nearest whole one, so a
    background that takes a fraction of a core (an editor, a browser tab) does not count."""
    free = max(1, round(cores - busy))
    return free if threads > free else None


def cpu_share_hint(config, busy: float | None, cores: int | None = None) -> str | None:
    """The warning for ``config``'s CPU thread counts beside ``busy`` cores of other work, or None."""
    if busy is None:
        return None
    cores = cores or os.cpu_count() or 1
    threads = max([config.torch_threads, *(config.rl_threads(role) for role in config.model_roles())])
    fits = fitting_threads(threads, busy, cores)
    if fits is None:
        return None
    return (f"warning: other processes keep about {busy:.1f} of this machine's {cores} core{'s' * (cores != 1)} "
            f"busy, and each worker "
            f"runs {threads} torch threads, which then wait for each other at every parallel operation (measured "
            f"on 2 cores with one busy process: 3.9x slower steps). torch_threads={fits} fits beside them.")


def warn_if_cores_busy(config) -> None:
    """Print :func:`cpu_share_hint`'s warning for a run of ``config`` on CPU, measured now."""
    import torch

    if torch.cuda.is_available():  # the devices compute; the CPU threads mostly wait for them
        return
    hint = cpu_share_hint(config, busy_cores())
    if hint:
        print(hint, flush=True)
