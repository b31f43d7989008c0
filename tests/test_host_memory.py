"""runtime.reuse_freed_memory: a CPU worker keeps the memory it frees, so the next step does not fault it in."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from roll_core.config import load_config
from roll_core.runtime import host_memory

glibc = pytest.mark.skipif(host_memory._glibc() is None, reason="mallopt is glibc's")

# Allocates and frees 384 MiB of activations-sized tensors (above glibc's largest mmap threshold, 32 MiB) in rounds (steps) and prints the minor page
# faults of the third: what a step pays for the memory the last one freed, once the peak is reached.
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
    step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _later_round_faults(reuse: bool) -> int:
    out = subprocess.run([sys.executable, "-c", LATER_ROUND_FAULTS, str(int(reuse))],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@glibc
def test_freed_memory_is_reused_without_page_faults():
    """By default glibc returns freed blocks to the kernel and every page of the next round faults in
    again (98304 pages of 4 KiB for 384 MiB); kept, later rounds reuse them."""
    assert _later_round_faults(reuse=False) > 10_000
    assert _later_round_faults(reuse=True) < 500


@pytest.mark.parametrize(("overrides", "devices", "applied"), [
    ([], None, True),                                       # a CPU worker, the default
    (["runtime.reuse_freed_memory=false"], None, False),    # turned off
    ([], [0], False),                                       # a worker with a device leaves the allocator alone
])
def test_cpu_workers_keep_freed_memory_unless_told_not_to(monkeypatch, tiny_model_path, overrides, devices, applied):
    from roll_core.runtime import workers

    calls = []
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: calls.append(True))
    monkeypatch.setattr(workers, "_bind_devices", lambda devices: None)  # keep this process's CUDA view
    cfg = load_config(None, ["executor=local", *overrides])
    workers.InferWorker("actor_infer", str(tiny_model_path), cfg.roles.actor_infer, cfg, seed=0, devices=devices)
    assert calls == ([True] if applied else [])


def test_outside_glibc_nothing_changes(monkeypatch):
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    host_memory.keep_freed_memory.cache_clear()
    try:
        assert host_memory.keep_freed_memory() is False
    finally:
        host_memory.keep_freed_memory.cache_clear()
