"""The distributed runtime on Ray: data-parallel training (``hf`` and ``fsdp2`` over gloo), a
simulated 2-node cluster with 8 declared GPUs per node, and collective weight sync."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import metrics_of

from roll_core.algorithms.objective import ActorObjective
from roll_core.config import load_config
from roll_core.strategies.hf import HFTrainStrategy
from roll_core.training import UpdateSpec, update
from roll_core.testing import assert_run_survives_a_killed_worker, data_parallel_update, full_weights, training_batch

pytestmark = pytest.mark.ray

DP = ["executor=ray", "rollout.prompts_per_step=2", "rollout.num_return_sequences=4", "rollout.max_new_tokens=5",
      "algorithm.ppo_mini_batch_size=4", "algorithm.kl_loss_coef=0.1", "algorithm.entropy_coef=0.01",
      "roles.actor_train.micro_batch_size=1"]


@pytest.mark.parametrize("strategy", ["hf", "fsdp2", "fsdp2 compiled", "fsdp2 bf16", "fsdp2 lora"])
def test_two_data_parallel_workers_match_one_worker_on_the_whole_batch(tiny_model_path, strategy):
    """``fsdp2 compiled``: FSDP2's gathers run around decoder layers compiled by ``compile: true``.
    ``fsdp2 bf16``: its forward passes under bf16 autocast, against one ``hf`` worker in bf16 (the
    metrics, to 1e-4, tell bf16's numbers from fp32's). ``fsdp2 lora``: LoRA adapters sharded beside
    the frozen base, against one ``hf`` worker's adapters (what a sync sends)."""
    name, _, variant = strategy.partition(" ")
    compiled, precision = variant == "compiled", ("bf16" if variant == "bf16" else "fp32")
    both = DP + [f"roles.actor_train.strategy_options.precision={precision}"]
    if variant == "lora":
        pytest.importorskip("peft")
        both.append("roles.actor_train.lora={rank: 8, alpha: 16}")
    cfg = load_config(None, both + [f"roles.actor_train.strategy={name}", "roles.actor_train.num_workers=2",
                                    f"roles.actor_train.compile={compiled}"])
    one_cfg = load_config(None, both)
    single = HFTrainStrategy(str(tiny_model_path), one_cfg.roles.actor_train, seed=0)
    batch = training_batch(single.model.config.vocab_size)
    before = {n: t.clone() for n, t in full_weights(single).items()}  # what a sync sends: LoRA's adapters alone
    expected_metrics = update(single, batch, ActorObjective.from_config(one_cfg.algorithm, one_cfg.rollout),
                              UpdateSpec.from_config(one_cfg.algorithm, one_cfg.roles.actor_train))  # 2 steps
    expected = full_weights(single)

    metrics, ranks, log_probs = data_parallel_update(str(tiny_model_path), cfg, batch, world=2)
    params, replica = ranks  # rank 0 sends every weight (full tensors), the replica nothing
    assert replica == {} and params.keys() == expected.keys()
    # compiled kernels sum in another order, and Adam scales each element's gradient to a move of about
    # lr (3e-4 a step): 2e-6 apart on the Intel Xeon, 1.2e-5 on a Zen 2 EPYC (MKL), against moves of 6e-4
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=3e-5 if compiled else 1e-6, msg=name)
    torch.testing.assert_close(log_probs[0], log_probs[1])  # every rank ends with the same weights
    moved = max(float((expected[n] - before[n]).abs().max()) for n in expected)
    assert moved > 1e-4  # the step really changed the weights
    for key in ("train/pg_loss", "train/kl", "train/entropy", "train/grad_norm"):
        assert metrics[0][key] == pytest.approx(expected_metrics[key], rel=1e-4, abs=1e-6), key


def _cli(run_dir, *overrides):
    return [sys.executable, "-m", "roll_core.cli", "run", f"output_dir={run_dir}", "warmup.steps=20",
            "rollout.prompts_per_step=4", "rollout.num_return_sequences=4", "trainer.eval_every=0",
            "data.eval_size=16", "trackers=[jsonl]", "torch_threads=1", *overrides]


@pytest.fixture(scope="module")
def two_gpu_nodes():
    """A Ray cluster on this machine: a head without GPUs and two nodes declaring 8 GPUs each."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    nodes = [cluster.add_node(num_cpus=1, num_gpus=8) for _ in range(2)]
    cluster.wait_for_nodes()
    yield cluster.address, {n.node_id for n in nodes}
    cluster.shutdown()


LAYOUTS = {
    # actor_train (FSDP2 over two workers) and actor_infer share node 0's first two GPUs
    # (time-shared through offload),
    # the reference sits next to them and the reward on node 1.
    "colocated": ["roles.actor_train.strategy=fsdp2",
                  "roles.actor_train.device_mapping=[0,1]", "roles.actor_infer.device_mapping=[0,1]",
                  "roles.reference.device_mapping=[2]", "roles.reward.device_mapping=[8]", "algorithm.kl_metric=true"],
    # every role on its own GPUs, the inference workers on the second node.
    "disaggregated": ["roles.actor_train.device_mapping=[0,1]", "roles.actor_infer.device_mapping=[8,9]",
                      "roles.reference.device_mapping=[2]", "roles.reward.device_mapping=[10]",
                      "algorithm.kl_metric=true"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_roles_land_where_the_mapping_says_on_a_two_node_cluster(two_gpu_nodes, tmp_path, layout):
    address, gpu_nodes = two_gpu_nodes
    run_dir = tmp_path / layout
    out = subprocess.run(_cli(run_dir, f"ray.address={address}", "trainer.max_steps=2", *LAYOUTS[layout]),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    placement = json.loads((run_dir / "placement.json").read_text())
    nodes = placement["nodes"]
    assert len(nodes) == 2 and set(nodes) == gpu_nodes  # node rank -> the node its 8 devices are on
    cfg = load_config(None, LAYOUTS[layout] + ["executor=ray"])
    for role in ("actor_train", "actor_infer", "reference", "reward"):
        workers = placement["roles"][role]
        spec = getattr(cfg.roles, role).worker_devices()
        assert len(workers) == len(spec)
        for worker, devices in zip(workers, spec):
            assert worker["node_id"] == nodes[devices[0] // 8], (role, worker)
            assert worker["cuda_visible_devices"] == ",".join(str(d % 8) for d in devices), (role, worker)
    assert len({w["pid"] for ws in placement["roles"].values() for w in ws}) == 6  # one process per worker
    steps = metrics_of(run_dir)
    assert [m["step"] for m in steps] == [0, 1, 2]
    assert all("train/grad_norm" in m and "train/pg_loss" in m for m in steps[1:])
    if layout == "colocated":
        assert "placement on 2 node(s) x 8 devices" in out.stdout and "colocated actor_infer+actor_train" in out.stdout
        # per step: the trainer leaves for generation, then generation leaves for training
        assert steps[-1]["colocation/offloads"] >= 2 and steps[-1]["colocation/reloads"] >= 2
    else:
        assert "(disaggregated)" in out.stdout
        assert "colocation/offloads" not in steps[-1]


def test_a_mapping_beyond_the_cluster_fails_before_any_worker_starts(two_gpu_nodes, tmp_path):
    address, _ = two_gpu_nodes
    out = subprocess.run(_cli(tmp_path / "run", f"ray.address={address}", "roles.actor_infer.device_mapping=[15,16]"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "key 'roles.actor_infer.device_mapping': device 16 is beyond the cluster's 16 devices" in out.stderr
    assert not (tmp_path / "run" / "placement.json").exists()


def test_a_killed_worker_restarts_the_run_from_its_last_checkpoint(tmp_path):
    # The trainer is FSDP2 over two workers, so the restart also reloads a sharded checkpoint.
    # Without restarts the run stops with a message that says how to resume: test_restarts.py's
    # message, test_controller.py's whole run with runtime.max_restarts=0.
    assert_run_survives_a_killed_worker(tmp_path / "run", "roles.actor_train.strategy=fsdp2",
                                        "roles.actor_train.num_workers=2")


_DIE_WHILE_SAVING_STEP_4 = """
import os, signal, sys
from roll_core.pipelines.checkpoint import CheckpointManager

original = CheckpointManager.save

def save(self, step, write, state):
    if step == 4:
        def write_then_die(tmp):
            write(tmp)  # the model and optimizer files are on disk, state.json is not
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, step, write_then_die, state)
    return original(self, step, write, state)

CheckpointManager.save = save
from roll_core.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_dying_while_saving_leaves_the_previous_checkpoint_loadable(tmp_path):
    script = tmp_path / "die.py"
    script.write_text(_DIE_WHILE_SAVING_STEP_4)
    run_dir = tmp_path / "run"
    cmd = _cli(run_dir, "executor=local", "trainer.max_steps=4", "trainer.save_every=2")
    out = subprocess.run([sys.executable, str(script), *cmd[3:]], capture_output=True, text=True, timeout=600)
    assert out.returncode == -9
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if ".tmp-" not in p.name) == ["step_000000", "step_000002"]
    assert any(".tmp-" in p.name for p in ckpts.iterdir())  # the half-written one
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resumed from {ckpts / 'step_000002'} at step 2" in out.stdout
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000004"]  # leftover removed


def test_engines_with_concurrent_requests_get_workers_that_overlap_calls():
    """``InferStrategy.concurrent_requests``: the worker runs up to max_running_requests calls at once."""
    import ray

    from roll_core.runtime.executor import RayExecutor
    from roll_core.strategies.hf import HFInferStrategy

    assert HFInferStrategy.concurrent_requests is False  # batch-at-a-time: calls stay ordered

    class _Sleeper:  # defined here so that Ray ships it by value
        def nap(self, seconds):
            import time

            t0 = time.perf_counter()
            time.sleep(seconds)
            return t0, time.perf_counter()

    executor = RayExecutor(num_cpus=2, timeout_s=60)
    try:
        for concurrency, overlap in ((1, False), (2, True)):
            group = executor.spawn("sleepers", _Sleeper, [()], concurrency=concurrency)
            (a0, a1), (b0, b1) = executor.get([executor.invoke(group.handles[0], "nap", (0.5,), {}) for _ in range(2)])
            assert (max(a0, b0) < min(a1, b1)) is overlap
    finally:
        executor.shutdown()
        ray.shutdown()
