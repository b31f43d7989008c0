"""runtime.reuse_freed_memory: a CPU worker keeps the memory it frees, so the next step does not fault it in."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

from roll_core.config import load_config
from roll_core.runtime import host_memory

# decided apart from the code under test, so a broken glibc probe fails these tests instead of skipping them
ON_GLIBC = platform.libc_ver()[0] == "glibc"
glibc = pytest.mark.skipif(not ON_GLIBC, reason="mallopt is glibc's")

# Allocates and frees 384 MiB of activations-sized tensors (above glibc's largest mmap threshold,
# 32 MiB) in rounds, like training steps, and prints the minor page faults of rounds 3-6 together:
# what steps pay for the memory the steps before them freed, once the peak is reached.
LATER_ROUND_FAULTS = textwrap.dedent("""
    import resource, sys, torch
    from roll_core.runtime import host_memory
    if sys.argv[1] == "1":
        assert host_memory.keep_freed_memory()
    def step():
        tensors = [torch.ones(64 * 2**20 // 4) for _ in range(6)]  # 6 x 64 MiB, touched
        del tensors
    step()
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")
ROUND_PAGES = 6 * 64 * 2**20 // 4096  # one round's memory in 4 KiB pages


def _later_round_faults(reuse: bool) -> int:
    out = subprocess.run([sys.executable, "-c", LATER_ROUND_FAULTS, str(int(reuse))],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@glibc
def test_freed_memory_is_reused_without_page_faults():
    """By default glibc returns freed blocks to the kernel and every page of every round faults in
    again; kept, later rounds reuse them. (Fragmentation left by the interpreter's small objects can
    still place one 64 MiB tensor on fresh pages now and then: less than a round's worth in all.)"""
    assert _later_round_faults(reuse=False) > 3.5 * ROUND_PAGES
    assert _later_round_faults(reuse=True) < ROUND_PAGES


@pytest.mark.parametrize(("overrides", "devices", "applied"), [
    ([], None, True),                                       # a CPU worker, the default
    (["runtime.reuse_freed_memory=false"], None, False),    # turned off
    ([], [0], False),                                       # a worker with a device leaves the allocator alone
])
def test_cpu_workers_keep_freed_memory_unless_told_not_to(monkeypatch, tiny_model_path, overrides, devices, applied):
    from roll_core.runtime import workers

    calls = []
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: calls.append(True))
    monkeypatch.setattr(workers, "bind_devices", lambda devices: None)  # keep this process's CUDA view
    cfg = load_config(None, ["executor=local", *overrides])
    workers.InferWorker("actor_infer", str(tiny_model_path), cfg.roles.actor_infer, cfg, seed=0, devices=devices)
    assert calls == ([True] if applied else [])


def test_both_knobs_are_set(monkeypatch):
    """mmap off alone still lets glibc trim the heap's free top now and then (seen: 0 or 131040
    faults over four rounds); both must be set."""
    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(host_memory, "_glibc", lambda: FakeLibc())
    host_memory.keep_freed_memory.cache_clear()
    try:
        assert host_memory.keep_freed_memory() is True
    finally:
        host_memory.keep_freed_memory.cache_clear()
    assert sorted(calls) == sorted([(host_memory.M_MMAP_MAX, 0), (host_memory.M_TRIM_THRESHOLD, 2**31 - 1)])
    assert (host_memory.M_MMAP_MAX, host_memory.M_TRIM_THRESHOLD) == (-4, -1)  # malloc.h's numbers


def test_the_probe_finds_glibc_exactly_where_the_process_runs_on_it():
    libc = host_memory._glibc()
    assert (libc is not None) == ON_GLIBC
    if ON_GLIBC:
        assert callable(libc.mallopt)


def test_outside_glibc_nothing_changes(monkeypatch):
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    host_memory.keep_freed_memory.cache_clear()
    try:
        assert host_memory.keep_freed_memory() is False
    finally:
        host_memory.keep_freed_memory.cache_clear()
