"""The sampling benchmarks still run against the sampler and cache they measure (they patch both, so a
changed signature breaks them first), the GPU's cuDNN A/B against the strategies it drives (on the
CPU), and the Compiled Graphs record against Ray's beta API. Timings mean nothing here: the smallest
batch, one round."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench(script: str, *args: str) -> list[str]:
    """The output lines of ``script`` run with ``args``."""
    out = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True,
                         text=True, timeout=300, cwd=BENCHMARKS)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


@pytest.mark.parametrize("mode, contenders", [([], 5), (["--vocab", "300", "--top-p", "0.9"], 5), (["--finish"], 2)],
                         ids=["equal-work", "vocabulary-and-top-p", "finish"])
def test_bench_sampling_runs_and_compares_its_contenders(mode, contenders):
    lines = _bench("bench_sampling.py", "--batch", "16", "--new-tokens", "4", "--repeats", "1", *mode)
    rows = [line for line in lines if "tokens/s" in line]
    assert len(rows) == contenders, lines
    assert rows[0].rstrip().endswith("is 1.00x faster")  # the first contender is the reference


def test_bench_sampling_replays_the_quickstart_s_generate_call_against_the_sampler_before():
    lines = _bench("bench_sampling.py", "--rl-step", "1", "--repeats", "1", "--warmup-steps", "5")
    rows = [line for line in lines if "tokens/s" in line]
    assert [row.split()[0] for row in rows] == ["roll", "the"], lines
    assert any("RL step 1: 256 rows" in line for line in lines)


def test_bench_cli_exit_times_a_command_exiting_both_ways():
    lines = _bench("bench_cli_exit.py", "--rounds", "1", "--commands", "validate")
    (row,) = [line for line in lines if line.startswith("roll validate")]
    assert row.endswith("x") and row.count("s ") >= 4, lines


def test_bench_startup_times_a_process_with_and_without_torchdynamo():
    """Each child reports whether TorchDynamo was imported: the script stops where a way is not what
    its row says (``lazy`` importing it anyway)."""
    lines = _bench("bench_startup.py", "--rounds", "1", "--commands", "workers")
    (row,) = [line for line in lines if line.startswith("import the strategies and workers")]
    eager, lazy, ratio = row.split()[-3:]
    assert float(eager.rstrip("s")) > 0 and float(lazy.rstrip("s")) > 0 and ratio.endswith("x"), lines


def test_profile_generate_times_its_contenders_and_profiles_roll_s_call():
    """The GPU's generate profile runs on any device (on a CPU without the graph contenders)."""
    lines = _bench("profile_generate.py", "--new-tokens", "3", "--rounds", "1")
    rounds = [line for line in lines if line.startswith("round 0:")]
    cells = rounds[0].removeprefix("round 0: ").split("  ")
    names = [" ".join(c.split()[:2]) for c in cells]
    assert names == ["roll fp32", "roll bf16", "hf.generate fp32", "hf.generate bf16"], lines
    assert any(line.startswith("  #model_forward") and " count      3 " in line for line in lines), lines
    assert any(line.startswith("  #next_tokens") and " count      3 " in line for line in lines), lines


def test_profile_update_counts_only_the_products_a_forward_and_backward_pass_need():
    """On the tiny model's packed batch the products' FLOPs are 6 x parameters x positions, within
    what the embedding (a lookup, not a product) leaves out: no prompt computed twice, no extra pass."""
    lines = _bench("profile_update.py", "--rounds", "1", "--top", "3")
    (ratio,) = [line for line in lines if line.startswith("products' GFLOP / (6 x parameters x positions)")]
    assert 0.97 < float(ratio.split()[-1].rstrip("x")) <= 1.0, lines
    assert len(lines) - lines.index("other operators, self time:") - 1 == 3, lines  # --top 3


def test_bench_next_token_checks_every_draw_against_the_sorted_nucleus():
    lines = _bench("bench_next_token.py", "--rows", "8", "--vocab", "500", "--top-p", "1.0", "0.5", "--spread", "3",
                   "--rounds", "1")
    rows = [line.split() for line in lines if line.startswith("       500")]
    assert [row[1] for row in rows] == ["1.0", "0.5"], lines
    assert [row[-2] for row in rows] == ["True", "True"] and all(float(row[-1]) < 1e-4 for row in rows), lines


def test_bench_cudnn_attention_times_each_setting_on_the_strategies():
    """The GPU A/B of cuDNN's attention runs on any device (on a CPU the switch changes nothing)."""
    lines = _bench("bench_cudnn_attention.py", "--rounds", "1", "--new-tokens", "2", "--model", "tiny")
    (round_,) = [line for line in lines if line.startswith("round 0: ")]
    assert round_.count("generate ") == 3 and round_.count("update bf16 ") == 2, lines


@pytest.mark.ray
def test_bench_compiled_graph_compares_a_task_and_a_graph_on_the_same_worker():
    """The record of why a step's calls travel as a Ray task (docs/benchmarks.md, Ray overheads)."""
    lines = _bench("bench_compiled_graph.py", "--rounds", "1", "--calls", "3", "--work-ms", "5")
    assert [line.split()[0] + " " + line.split()[1] for line in lines if line.startswith(("ray task", "compiled"))] \
        == ["ray task", "compiled graph"], lines
    assert any(line.startswith("idle, cores in use: worker") for line in lines), lines
