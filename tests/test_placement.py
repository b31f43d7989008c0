"""Device mappings are checked before anything starts, and colocated roles time-share devices."""

import os
from pathlib import Path

import pytest
import torch
from conftest import proc_cmdline, proc_stat

from roll_core.config import load_config
from roll_core.data import Batch, dp_shards
from roll_core.errors import ConfigError
from roll_core.plugins import get_plugins
from roll_core.runtime.executor import LocalExecutor
from roll_core.runtime.placement import (Residency, check_cluster, colocated, hybrid_engine, hybrid_engine_blocker,
                                         nodes_needed, worker_slots)

RAY = ["executor=ray"]


def test_mapping_as_list_or_range_fixes_the_workers():
    cfg = load_config(None, RAY + ["roles.actor_train.device_mapping=[0,1,2,3]",
                                   "roles.actor_infer.device_mapping={start: 4, stop: 8}",
                                   "roles.actor_infer.num_devices_per_worker=2"])
    assert cfg.roles.actor_train.num_workers == 4
    assert cfg.roles.actor_infer.num_workers == 2
    assert cfg.roles.actor_infer.worker_devices() == [[4, 5], [6, 7]]
    slots = worker_slots(cfg.roles.actor_infer, per_node=4)
    assert [(s.node, s.local_devices) for s in slots] == [(1, (0, 1)), (1, (2, 3))]
    assert nodes_needed(cfg, per_node=4) == 2


@pytest.mark.parametrize("overrides, message", [
    (["roles.actor_train.device_mapping=[0,1,1]"], "lists devices [1] twice"),
    (["roles.actor_infer.device_mapping=[0,1,2]", "roles.actor_infer.num_devices_per_worker=2"],
     "does not divide into workers"),
    (["roles.actor_infer.device_mapping=[0,1]", "roles.actor_infer.num_workers=3"], "makes 2 workers"),
    (["roles.actor_train.device_mapping=[0,1]", "roles.reward.device_mapping=[1]"],
     "roles.reward.device_mapping overlaps roles.actor_train on devices [1]"),
    (["roles.actor_train.device_mapping=[0,1]", "roles.actor_infer.device_mapping=[1,2]",
      "rollout.scheduler=async", "rollout.async_generation_ratio=1"], "disjoint device_mapping"),
    (["executor=local", "roles.actor_infer.device_mapping=[0]"], "needs executor: ray"),
    (["executor=local", "roles.actor_train.num_workers=2"], "data-parallel training) needs executor: ray"),
    (["executor=local", "runtime.weight_sync=collective"], "runtime.weight_sync: collective needs executor: ray (the "
     "local executor runs every worker in one process); use object_store or auto"),
    (["executor=local", "runtime.weight_sync=in_process", "rollout.scheduler=async", "rollout.async_generation_ratio=1"],
     "in_process hands the engine the trainer's weights in its process, but the 'async' scheduler generates while"),
    (["executor=local", "runtime.weight_sync=in_process", "pipeline=agentic", "agentic.rollout=async"],
     "in its process, but agentic.rollout: async generates while the policy trains; use object_store or auto"),
    (["executor=local", "roles.reference.torch_threads=1"], "roles.reference.torch_threads needs executor: ray"),
    (["roles.actor_train.num_workers=3"], "must divide the samples per step"),
    (["roles.actor_train.num_workers=2", "algorithm.ppo_mini_batch_size=33"],
     "roles.actor_train.num_workers (2) must divide algorithm.ppo_mini_batch_size (33): every data-parallel"),
    (["roles.actor_train.num_workers=2", "algorithm.ppo_mini_batch_size=32", "rollout.prompts_per_step=33"],
     "must divide the samples per step"),
    (["roles.actor_train.device_mapping=[0,1,2,3]", "runtime.num_gpus_per_node=2", "runtime.num_nodes=1"],
     "device 2 is beyond the cluster's 2 devices"),
    (["roles.actor_infer.device_mapping=[6,7,8,9]", "roles.actor_infer.num_devices_per_worker=4",
      "runtime.num_gpus_per_node=8"], "span nodes"),
    (["roles.actor_train.device_mapping=[]"], "device_mapping is empty"),
    (["ray.hybrid_engine=true", "rollout.scheduler=async", "rollout.async_generation_ratio=1"],
     "ray.hybrid_engine: true, but the 'async' scheduler generates while the policy trains; use auto"),
    (["ray.hybrid_engine=true", "roles.actor_infer.device_mapping=[0]"], "runs CPU workers only"),
    (["ray.hybrid_engine=true", "roles.actor_infer.num_workers=2"], "num_workers of 1"),
    (["ray.hybrid_engine=true", "roles.actor_train.num_workers=2"], "num_workers of 1"),
    (["ray.hybrid_engine=true", "roles.actor_infer.torch_threads=1"], "different torch_threads"),
])
def test_bad_mappings_are_config_errors_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, RAY + overrides)
    assert message in str(err.value)


@pytest.mark.parametrize("overrides, reason", [
    ([], None),
    (["ray.hybrid_engine=false"], None),  # possible, but turned off
    (["rollout.scheduler=async", "rollout.async_generation_ratio=1"],
     "the 'async' scheduler generates while the policy trains"),
    (["pipeline=agentic", "agentic.rollout=async", "rollout.async_generation_ratio=1"],
     "agentic.rollout: async generates while the policy trains"),
    (["pipeline=agentic"], None),  # its synchronous rollout waits for the update
    (["roles.actor_train.device_mapping=[0]"],
     "it runs CPU workers only (actor_train and actor_infer without a device_mapping)"),
    (["roles.actor_infer.num_workers=2"],
     "it needs roles.actor_train.num_workers and roles.actor_infer.num_workers of 1"),
    (["roles.actor_train.torch_threads=1"],
     "actor_train and actor_infer have different torch_threads (a process has one thread count)"),
])
def test_the_hybrid_engine_applies_where_one_process_can_serve_both_roles(overrides, reason):
    cfg = load_config(None, RAY + overrides)
    assert hybrid_engine_blocker(cfg) == reason
    assert hybrid_engine(cfg) == (reason is None and "ray.hybrid_engine=false" not in overrides)
    assert not hybrid_engine(load_config(None, ["executor=local"]))  # every role in one process already


@pytest.mark.parametrize("attribute", ["concurrent_requests", "sharded"])
def test_an_engine_of_its_own_keeps_a_process_of_its_own(monkeypatch, attribute):
    cfg = load_config(None, RAY)
    monkeypatch.setattr(get_plugins().infer_strategies, "get", lambda name: type("Engine", (), {attribute: True}))
    assert hybrid_engine_blocker(cfg) == "actor_infer's strategy 'hf' is an engine of its own (concurrent or sharded)"
    assert not hybrid_engine(cfg)


def test_mapping_is_checked_against_the_running_cluster():
    cfg = load_config(None, RAY + ["roles.actor_train.device_mapping=[0,1]", "roles.actor_infer.device_mapping=[8,9]",
                                   "roles.reward.device_mapping=[16]"])
    assert check_cluster(cfg, [0, 8, 8, 8]) == 8  # a head without GPUs and three 8-GPU nodes
    with pytest.raises(ConfigError, match="device 16 is beyond the cluster's 16 devices"):
        check_cluster(cfg, [0, 8, 8])
    with pytest.raises(ConfigError, match="has no GPU resources"):
        check_cluster(cfg, [0, 0])
    assert check_cluster(load_config(None, RAY), [0]) == 0  # no mappings: nothing to check


def test_colocation_is_read_from_overlapping_mappings():
    cfg = load_config(None, RAY + ["roles.actor_train.device_mapping=[0,1]", "roles.actor_infer.device_mapping=[1,2]",
                                   "roles.reference.device_mapping=[3]"])
    assert colocated(cfg) == {"actor_train": {"actor_infer"}, "actor_infer": {"actor_train"}, "reference": set()}


class _Recorder:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def offload(self):
        self.log.append(("offload", self.name))

    def reload(self):
        self.log.append(("reload", self.name))


def test_residency_offloads_the_other_colocated_role_and_reloads_on_use():
    log: list = []
    ex = LocalExecutor()
    groups = {n: ex.spawn(n, _Recorder, [(log, n)]) for n in ("actor_train", "actor_infer", "reference")}
    r = Residency(ex, groups, {"actor_train": {"actor_infer"}, "actor_infer": {"actor_train"}, "reference": set()})
    r.use("actor_infer")                   # generation: the trainer leaves the devices
    r.use("reference")                     # disjoint: nothing moves
    r.use("actor_train")                   # training: generation leaves, the trainer comes back
    r.use("actor_train", "actor_infer")    # weight sync needs both
    assert log == [("offload", "actor_train"),
                   ("offload", "actor_infer"), ("reload", "actor_train"),
                   ("reload", "actor_infer")]
    assert r.metrics()["colocation/offloads"] == 2 and r.metrics()["colocation/reloads"] == 2
    assert Residency(ex, groups, {}).metrics() == {}


def test_dp_shards_give_each_rank_its_part_of_every_mini_batch():
    batch = Batch({"x": torch.arange(8)})
    shards = dp_shards(batch, 2, mini_batch_size=4)
    assert [s["x"].tolist() for s in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [s["x"].tolist() for s in dp_shards(batch, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dp_shards(batch, 1)[0] is batch


def test_each_kind_of_role_offers_its_own_methods_and_a_wrong_call_names_the_role():
    from roll_core.errors import RollError
    from roll_core.runtime.workers import CriticWorker, InferWorker, TrainWorker

    assert {"update", "send_weights", "write_weights", "save_checkpoint"} <= set(dir(TrainWorker))
    assert not {"generate", "receive_weights", "read_weights", "compute_values"} & set(dir(TrainWorker))
    assert {"generate", "receive_weights", "read_weights", "top_k_log_probs"} <= set(dir(InferWorker))
    assert not {"update", "send_weights", "write_weights", "save_checkpoint", "compute_values"} & set(dir(InferWorker))
    assert {"compute_values", "update"} <= set(dir(CriticWorker)) and "generate" not in dir(CriticWorker)

    cfg = load_config(None, ["executor=local"])
    # the worker is never set up: the refusal comes before any call reaches it
    group = LocalExecutor().spawn("actor_infer", InferWorker, [("actor_infer", "unused", cfg.roles.actor_infer, cfg, 0)])
    with pytest.raises(RollError, match=r"actor_infer: its workers \(InferWorker\) have no method 'update'; "
                                        r"they offer .*generate"):
        group.call("update", None, None, None)
    reference = group.as_role("reference", compute_log_probs="base_log_probs")
    with pytest.raises(RollError, match="reference: .* no method 'base_log_probs'"):
        reference.call("compute_log_probs", None, 1.0)


def test_a_local_ray_cluster_starts_its_workers_at_the_configured_niceness(monkeypatch):
    """Ray's default niceness (15) lets the driver preempt workers; roll starts its cluster at 0, and
    with batches up to RAY_INLINE_BYTES carried inside task messages."""
    ray = pytest.importorskip("ray")  # no cluster starts (ray.init is replaced), but the module is needed

    from roll_core.config import load_config
    from roll_core.runtime.executor import RAY_INLINE_BYTES, make_executor

    started = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: started.update(kwargs))
    make_executor(load_config(None, ["executor=ray"]))
    assert started["_system_config"] == {"worker_niceness": 0, "prestart_worker_first_driver": False,
                                         "max_direct_call_object_size": RAY_INLINE_BYTES}
    assert 256 * 1024 <= RAY_INLINE_BYTES <= 1024 * 1024  # above a quickstart batch, below the store's break-even
    make_executor(load_config(None, ["executor=ray", "ray.worker_niceness=10"]))
    assert started["_system_config"] == {"worker_niceness": 10, "prestart_worker_first_driver": False,
                                         "max_direct_call_object_size": RAY_INLINE_BYTES}
    started.clear()
    make_executor(load_config(None, ["executor=ray", "ray.address=auto"]))
    assert "_system_config" not in started  # a joined cluster keeps its own setting


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below ``pid`` (parents read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = proc_stat(int(stat.parent.name))
        if fields is not None:  # else gone meanwhile
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))  # field 4, the parent
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            cmdline = proc_cmdline(child)
            if cmdline is not None:
                found.append((child, cmdline))
                todo.append(child)
    return found


@pytest.mark.ray
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_local_ray_cluster_holds_no_idle_task_workers():
    """roll's workers are actors: the task workers Ray would prestart (one per CPU) stay unstarted,
    so no idle process wakes beside the workers on a small machine."""
    import time

    import ray

    from roll_core.runtime.executor import RayExecutor

    class _Echo:  # defined here so that Ray ships it by value
        def pid(self):
            return os.getpid()

    executor = RayExecutor(num_cpus=2, timeout_s=60)
    try:
        group = executor.spawn("echo", _Echo, [()])
        actor_pid = executor.get(executor.invoke(group.handles[0], "pid", (), {}))
        time.sleep(3)  # prestarted workers would be up by now
        workers = [(pid, cmd) for pid, cmd in _descendants(os.getpid()) if cmd.startswith("ray::")]
        assert [pid for pid, cmd in workers if pid != actor_pid and "IDLE" in cmd] == [], workers
        assert actor_pid in [pid for pid, _ in workers]  # the scan sees Ray's workers at all
    finally:
        executor.shutdown()
        ray.shutdown()
