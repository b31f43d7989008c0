"""Weight sync backends: the shared-memory buffers' layout, an update that reaches every inference
worker's model, which backend ``auto`` picks, and the fallback when ``/dev/shm`` is too small.

The Ray paths of ``in_process`` (the hybrid engine) and ``shared_memory`` (separate processes, reads
ordered after writes by their results) run in
``tests/test_pipeline.py::test_same_seed_same_metrics_local_and_ray``, whose Ray runs pick them
through ``auto``; ``collective`` runs on the simulated two-node cluster of ``tests/test_distributed.py``.
"""

from __future__ import annotations

import glob
import types

import pytest
import torch

from roll_core.config import load_config
from roll_core.runtime import distributed, weight_sync
from roll_core.errors import RollError
from roll_core.runtime.executor import Hosted, LocalExecutor
from roll_core.runtime.weight_sync import InProcessSync, SharedMemorySync, SharedMemoryUnavailable, choose
from roll_core.runtime.workers import InferWorker, TrainWorker


def test_buckets_start_on_64_byte_boundaries_back_to_back():
    metas = [[("a", (5,), torch.float16)],  # 10 bytes
             [("b", (3, 4), torch.float32), ("c", (1,), torch.int8)],  # 49 bytes
             [("d", (2,), torch.float64)]]  # 16 bytes
    assert distributed.buffer_layout(metas) == ([0, 64, 128], 144)
    assert distributed.buffer_layout([]) == ([], 0)


def test_packing_into_a_buffer_matches_pack_bucket():
    bucket = [("w", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)), ("h", torch.randn(4).half())]
    out = torch.zeros(200, dtype=torch.uint8)
    distributed.pack_bucket_into(bucket, out)
    packed = distributed.pack_bucket(bucket)
    assert torch.equal(out[: packed.numel()], packed) and not out[packed.numel():].any()


@pytest.fixture
def workers(tiny_model_path):
    cfg = load_config(None, ["executor=local", "runtime.weight_bucket_mb=0.01"])  # several buckets
    executor = LocalExecutor()
    train = executor.spawn("actor_train", TrainWorker, [("actor_train", str(tiny_model_path), cfg.roles.actor_train,
                                                         cfg, 0)])
    infer = executor.spawn("actor_infer", InferWorker, [("actor_infer", str(tiny_model_path), cfg.roles.actor_infer,
                                                         cfg, 1) for _ in range(2)])
    executor.get(train.call("setup") + infer.call("setup"))
    return cfg, executor, train, infer


def _perturb(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.device) * 0.01)


def test_shared_memory_updates_reach_every_inference_worker_and_leave_no_file(workers):
    cfg, executor, train, infer = workers
    trainer = train.handles[0].strategy.model
    before = set(glob.glob("/dev/shm/roll-weights-*"))
    sync = SharedMemorySync(cfg, executor, train, infer, colocated=False)
    sync.setup()
    assert set(glob.glob("/dev/shm/roll-weights-*")) == before  # names removed once every worker mapped them
    assert sync.bytes_per_update == sum(p.numel() * p.element_size() for p in trainer.parameters())
    assert len(sync.metas[0]) > 1  # several buckets, so the layout's offsets are exercised
    for version, seed in ((1, 0), (2, 1)):  # the second update overwrites the buffer the first one left
        _perturb(trainer, seed)
        sync.update(new_version=True, wait=True)
        expected = dict(trainer.named_parameters())
        for worker in infer.handles:
            for name, param in worker.strategy.model.named_parameters():
                assert torch.equal(param, expected[name]), (version, name)


def test_in_process_updates_the_hosted_inference_worker_and_refuses_one_it_does_not_host(workers, tiny_model_path):
    cfg, executor, train, infer = workers
    hosted = executor.spawn_hosted("actor_infer", InferWorker, [("actor_infer", str(tiny_model_path),
                                                                 cfg.roles.actor_infer, cfg, 1)], train)
    assert hosted.handles == [Hosted(train.handles[0], "actor_infer")]
    executor.get(hosted.call("setup"))
    trainer, engine = train.handles[0].strategy.model, train.handles[0].hosted["actor_infer"].strategy.model
    sync = InProcessSync(cfg, executor, train, hosted, colocated=False)
    sync.setup()
    assert sync.bytes_per_update == sum(p.numel() * p.element_size() for p in trainer.parameters())
    for version, seed in ((1, 0), (2, 1)):
        _perturb(trainer, seed)
        sync.update(new_version=True, wait=True)
        expected = dict(trainer.named_parameters())
        for name, param in engine.named_parameters():
            assert torch.equal(param, expected[name]), (version, name)
            assert param.data_ptr() != expected[name].data_ptr()  # a copy: the engine never trains
    with pytest.raises(RollError, match="in_process needs every actor_infer worker built inside a actor_train "
                                        "worker .ray.hybrid_engine."):
        InProcessSync(cfg, executor, train, infer, colocated=False).setup()
    with pytest.raises(RollError, match="2 workers cannot live in actor_train's 1 worker processes"):
        executor.spawn_hosted("actor_infer", InferWorker, [()] * 2, train)


def test_explicit_shared_memory_says_how_much_dev_shm_it_needs(workers, monkeypatch):
    cfg, executor, train, infer = workers
    monkeypatch.setattr(weight_sync.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=1024))
    with pytest.raises(SharedMemoryUnavailable, match=r"needs \d+ MiB in /dev/shm, which has 0 MiB free.*"
                                                      r"--shm-size"):
        SharedMemorySync(cfg, executor, train, infer, colocated=False).setup()


def test_auto_falls_back_to_collective_when_dev_shm_is_too_small(workers, monkeypatch, capsys):
    cfg, executor, train, infer = workers
    monkeypatch.setattr(weight_sync.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=1024))
    monkeypatch.setattr(weight_sync, "choose", lambda config, overlaps: "shared_memory")

    class Collective(weight_sync.WeightSync):  # stands in for the broadcast groups, which need Ray
        def setup(self):
            self.set_up = True

        def push(self, version):
            return []

    backends = {"shared_memory": SharedMemorySync, "collective": Collective}
    plugins = types.SimpleNamespace(weight_syncs=types.SimpleNamespace(get=backends.__getitem__))
    sync = weight_sync.connect(cfg, executor, train, infer, False, plugins)
    assert isinstance(sync, Collective) and sync.set_up
    assert "falls back to collective" in capsys.readouterr().out
    explicit = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"weight_sync": "shared_memory"})})
    with pytest.raises(SharedMemoryUnavailable, match="runtime.weight_sync: collective works anywhere"):
        weight_sync.connect(explicit, executor, train, infer, False, plugins)


@pytest.mark.parametrize("overrides, overlapping, expected", [
    (["executor=ray"], False, "in_process"),  # the hybrid engine: actor_infer lives in actor_train's process
    (["executor=ray", "ray.address=10.0.0.1:6379"], False, "in_process"),
    (["executor=ray", "ray.hybrid_engine=false"], False, "shared_memory"),  # a local cluster's CPU workers: one node
    (["executor=ray", "roles.actor_infer.torch_threads=1"], False, "shared_memory"),  # no hybrid engine
    (["executor=ray", "ray.hybrid_engine=false", "ray.address=10.0.0.1:6379"], False, "collective"),  # may span nodes
    (["executor=ray", "roles.actor_infer.device_mapping=[0]"], False, "collective"),
    (["executor=ray", "roles.actor_train.device_mapping=[0]"], False, "collective"),
    (["executor=ray"], True, "object_store"),  # a scheduler that trains while generating
    (["executor=local"], False, "object_store"),
    (["executor=ray", "runtime.weight_sync=collective"], False, "collective"),  # a chosen backend is kept
])
def test_auto_picks_the_backend_for_where_the_workers_are(overrides, overlapping, expected):
    assert choose(load_config(None, overrides), overlapping) == expected
