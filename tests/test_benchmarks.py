"""The sampling benchmark still runs against the sampler and cache it measures (it patches both, so a
changed signature breaks it first). Timings mean nothing here: the smallest batch, one round."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench_sampling(*args: str) -> list[str]:
    """``bench_sampling.py`` run with ``args``; the lines of its contenders."""
    out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_sampling.py"), *args], capture_output=True,
                         text=True, timeout=300, cwd=BENCHMARKS)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


@pytest.mark.parametrize("mode", [[], ["--finish"]], ids=["equal-work", "finish"])
def test_bench_sampling_runs_and_compares_its_contenders(mode):
    lines = _bench_sampling("--batch", "16", "--new-tokens", "4", "--repeats", "1", *mode)
    rows = [line for line in lines if "tokens/s" in line]
    assert len(rows) == (2 if mode else 3), lines
    assert rows[0].rstrip().endswith("is 1.00x faster")  # the first contender is the reference


def test_bench_sampling_replays_the_quickstart_s_generate_call_against_the_sampler_before():
    lines = _bench_sampling("--rl-step", "1", "--repeats", "1")
    rows = [line for line in lines if "tokens/s" in line]
    assert [row.split()[0] for row in rows] == ["roll", "the"], lines
    assert any("RL step 1: 256 rows" in line for line in lines)
