"""The sampling benchmark still runs against the sampler and cache it measures (it patches both, so a
changed signature breaks it first). Timings mean nothing here: the smallest batch, one round."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("mode", [[], ["--finish"]], ids=["equal-work", "finish"])
def test_bench_sampling_runs_and_compares_its_contenders(mode):
    out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_sampling.py"), "--batch", "16", "--new-tokens", "4",
                          "--repeats", "1", *mode], capture_output=True, text=True, timeout=300, cwd=BENCHMARKS)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if "tokens/s" in line]
    assert len(rows) == (2 if mode else 3), out.stdout
    assert rows[0].rstrip().endswith("is 1.00x faster")  # the first contender is the reference


def test_bench_sampling_replays_the_quickstart_s_generate_call_against_the_sampler_before():
    out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_sampling.py"), "--rl-step", "1", "--repeats", "1"],
                         capture_output=True, text=True, timeout=300, cwd=BENCHMARKS)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if "tokens/s" in line]
    assert [row.split()[0] for row in rows] == ["roll", "the"], out.stdout
    assert "RL step 1: 256 rows" in out.stdout
