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


@pytest.fixture
def hosted(workers, tiny_model_path):
    cfg, executor, train, infer = workers
    hosted = executor.spawn_hosted("actor_infer", InferWorker, [("actor_infer", str(tiny_model_path),
                                                                 cfg.roles.actor_infer, cfg, 1)], train)
    assert hosted.handles == [Hosted(train.handles[0], "actor_infer")]
    executor.get(hosted.call("setup"))
    return hosted


def test_in_process_has_the_hosted_engine_compute_with_the_trainers_own_tensors(workers, hosted):
    cfg, executor, train, infer = workers
    trainer, engine = train.handles[0].strategy.model, train.handles[0].hosted["actor_infer"].strategy.model
    own = {name: p.data_ptr() for name, p in engine.named_parameters()}
    sync = InProcessSync(cfg, executor, train, hosted, colocated=False)
    sync.setup()
    assert sync.bytes_per_update == 0  # nothing is sent
    assert sync.queues_behind_update is True  # one more call on the trainer's worker, run after its update
    assert {name: p.data_ptr() for name, p in engine.named_parameters()} == own  # setup changes nothing
    sync.update(new_version=True, wait=True)
    expected = dict(trainer.named_parameters())
    for name, param in engine.named_parameters():
        assert param.data_ptr() == expected[name].data_ptr(), name  # one copy of the weights in the process
    _perturb(trainer, 0)  # an update changes the trainer's tensors in place, as the optimizer does
    assert all(torch.equal(param, expected[name]) for name, param in engine.named_parameters())
    # a trainer whose tensors were replaced (not updated in place) is followed at the next update
    with torch.no_grad():
        for param in trainer.parameters():
            param.data = param.data.clone()
    sync.update(new_version=True, wait=True)
    assert all(param.data_ptr() == expected[name].data_ptr() for name, param in engine.named_parameters())


def test_in_process_copies_where_the_trainer_cannot_share(workers, hosted, monkeypatch):
    cfg, executor, train, infer = workers
    trainer, engine = train.handles[0].strategy.model, train.handles[0].hosted["actor_infer"].strategy.model
    monkeypatch.setattr(train.handles[0].strategy, "shared_parameters", lambda: None)  # as fsdp2 and LoRA
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


def test_in_process_on_the_local_executor_has_every_engine_compute_with_the_trainers_tensors(workers):
    cfg, executor, train, infer = workers  # two inference workers beside the trainer in the driver
    trainer = train.handles[0].strategy.model
    sync = InProcessSync(cfg, executor, train, infer, colocated=False)
    sync.setup()
    assert sync.bytes_per_update == 0 and not sync.queues_behind_update  # local calls have run: nothing queues
    sync.update(new_version=True, wait=True)
    expected = {name: p.data_ptr() for name, p in trainer.named_parameters()}
    for worker in infer.handles:
        assert {name: p.data_ptr() for name, p in worker.strategy.model.named_parameters()} == expected
    _perturb(trainer, 0)
    reference = dict(trainer.named_parameters())
    for worker in infer.handles:
        assert all(torch.equal(p, reference[name]) for name, p in worker.strategy.model.named_parameters())


def test_in_process_on_the_local_executor_copies_for_every_engine_from_one_gather(workers, monkeypatch):
    cfg, executor, train, infer = workers
    strategy = train.handles[0].strategy
    trainer = strategy.model
    monkeypatch.setattr(strategy, "shared_parameters", lambda: None)  # as fsdp2 and LoRA
    gathers = []
    buckets = strategy.weight_buckets
    monkeypatch.setattr(strategy, "weight_buckets", lambda size: gathers.append(size) or buckets(size))
    sync = InProcessSync(cfg, executor, train, infer, colocated=False)
    sync.setup()
    assert sync.bytes_per_update == sum(p.numel() * p.element_size() for p in trainer.parameters())
    gathers.clear()  # setup measured the buckets once
    _perturb(trainer, 0)
    sync.update(new_version=True, wait=True)
    assert len(gathers) == 1  # both engines loaded from one gather, as object_store did
    expected = dict(trainer.named_parameters())
    for worker in infer.handles:
        for name, param in worker.strategy.model.named_parameters():
            assert torch.equal(param, expected[name]) and param.data_ptr() != expected[name].data_ptr(), name


def test_in_process_refuses_engines_in_other_processes(workers):
    cfg, executor, train, infer = workers

    class Elsewhere(LocalExecutor):  # workers that are separate processes, as Ray's without the hybrid engine
        name = "ray"

    with pytest.raises(RollError, match=r"in_process needs every actor_infer worker in a actor_train worker's "
                                        r"process \(ray.hybrid_engine, or executor: local\)"):
        InProcessSync(cfg, Elsewhere(), train, infer, colocated=False).setup()
    with pytest.raises(RollError, match="2 workers cannot live in actor_train's 1 worker processes"):
        executor.spawn_hosted("actor_infer", InferWorker, [()] * 2, train)


def test_an_engine_shares_only_tensors_that_match_its_own_by_name_shape_dtype_and_device(workers):
    cfg, executor, train, infer = workers
    engine = infer.handles[0].strategy
    live = train.handles[0].strategy.shared_parameters()
    assert engine.can_share(live)
    name = next(iter(live))
    assert not engine.can_share({n: t for n, t in live.items() if n != name})  # a name missing
    assert not engine.can_share({**live, "extra.weight": live[name]})  # a name it does not have
    assert not engine.can_share({**live, name: live[name].double()})
    assert not engine.can_share({**live, name: live[name].reshape(-1)})
    assert not engine.can_share({**live, name: live[name].to("meta")})
    worker = infer.handles[0]
    assert worker.can_share_weights(live)
    worker.merger = object()  # LoRA adapters arrive to be merged onto a base: the engine keeps its own weights
    assert not worker.can_share_weights(live) and not worker.share_weights(1, live)


def test_only_the_plain_hf_trainer_hands_out_its_live_tensors(workers):
    from roll_core.strategies.fsdp2 import FSDP2TrainStrategy

    cfg, executor, train, infer = workers
    trainer = train.handles[0].strategy
    live = trainer.shared_parameters()
    assert {n: t.data_ptr() for n, t in live.items()} == {n: p.data_ptr() for n, p in trainer.model.named_parameters()}
    assert not any(t.requires_grad for t in live.values())  # detached: the engine cannot reach the graph
    sharded = object.__new__(FSDP2TrainStrategy)  # gathers shards in full_parameters: copies, never live
    sharded.lora = None
    assert sharded.shared_parameters() is None
    trainer.lora = object()  # under LoRA the engine gets merged weights, never the trainer's base
    assert trainer.shared_parameters() is None


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
    (["executor=local"], False, "in_process"),  # every worker is an object in the driver's process
    (["executor=local", "rollout.scheduler=async", "rollout.async_generation_ratio=1"], True, "object_store"),
    (["executor=local", "pipeline=agentic", "agentic.rollout=async"], False, "object_store"),  # generates meanwhile
    (["executor=ray", "pipeline=agentic", "agentic.rollout=async"], False, "shared_memory"),  # no hybrid engine
    (["executor=ray", "runtime.weight_sync=collective"], False, "collective"),  # a chosen backend is kept
])
def test_auto_picks_the_backend_for_where_the_workers_are(overrides, overlapping, expected):
    assert choose(load_config(None, overrides), overlapping) == expected
