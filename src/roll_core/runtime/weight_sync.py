"""Weight sync: the trained policy's weights reach the inference engines after every update.

The protocol, as an inference strategy sees it (:class:`roll_core.strategy.InferStrategy`)::

    begin_update(version)     an engine may pause generation here
    load(bucket)              for every bucket: [(Hugging Face parameter name, tensor), ...]
    end_update()              every bucket is in: reset the prefix cache, resume

On the training side every rank iterates ``weight_buckets`` (sharded strategies gather with
collectives there) and yields the buckets of the weights it owns: one rank of replicated data
parallelism, every pipeline stage's first rank once stages split the layers. A backend moves those
buckets; backends are a registered plugin kind (``roll_register_weight_syncs``), chosen with
``runtime.weight_sync`` (``auto``: ``object_store`` for a scheduler that generates while the
policy trains, and on the local executor for any rollout that does; else ``in_process`` on the local
executor and under Ray's hybrid engine, ``shared_memory`` when both roles run on CPU workers of a
cluster roll starts itself, and ``collective`` otherwise):

* ``collective``: each sending rank and every inference worker form a ``torch.distributed`` group of
  their own and each bucket is one broadcast (nccl when both sides are on GPUs and not colocated,
  gloo otherwise);
* ``shared_memory``: workers on one node (Ray's local cluster on a laptop or a CPU server): each
  sending rank writes its buckets into a buffer in ``/dev/shm`` that every inference worker maps
  and reads, one memory copy on each side instead of a socket's round trips. The inference side's
  read is ordered after the writes by taking their results as arguments; the next write waits
  until every read of the last update is done;
* ``object_store``: the buckets travel as call arguments (Ray's object store; memory when local);
* ``in_process``: the inference worker lives in the trainer's process, under the hybrid engine
  (``ray.hybrid_engine``) or on the local executor (``auto`` picks it there, for rollouts that wait
  for the update). Where both strategies allow it (``shared_parameters``, ``can_share``: ``hf`` on
  both sides without LoRA), the engine computes with the trainer's own parameter tensors, so the
  process holds the weights once and an update copies nothing; otherwise the trainer hands it the
  buckets in memory in one call.

A backend is constructed as ``cls(config, executor, trainer_group, infer_group, colocated)`` and
implements :meth:`WeightSync.push`; pipelines call :meth:`WeightSync.update`, which counts versions
and may leave an update queued. The update is ordered on each inference worker like any other call:
requests sent before it finish with the old weights.
"""

from __future__ import annotations

import shutil
import uuid
from abc import ABC, abstractmethod

from roll_core.errors import RollError
from roll_core.runtime import distributed
from roll_core.runtime.executor import Executor, Hosted, WorkerGroup
from roll_core.runtime.placement import colocated, generates_while_training, hybrid_engine

SHARED_MEMORY = "/dev/shm"


class WeightSync(ABC):
    """Moves the trainer's weight buckets to every inference worker."""

    def __init__(self, config, executor: Executor, trainer: WorkerGroup, infer: WorkerGroup, colocated: bool):
        self.config, self.executor = config, executor
        self.trainer, self.infer, self.colocated = trainer, infer, colocated
        self.bucket_bytes = int(config.runtime.weight_bucket_mb * 2**20)
        self.version = 0  # policy updates pushed so far
        self.bytes_per_update = 0  # what the training ranks send each update (weight_sync/bytes), set by setup
        self._queued: list = []  # futures of the update left queued behind running requests

    #: Whether :meth:`push` may be sent while the update still runs: its calls go to the training
    #: workers alone (a worker runs its calls in order), nothing else must be made resident for it,
    #: and so the weights it reads are the updated ones.
    queues_behind_update = False

    def update(self, *, new_version: bool, wait: bool) -> None:
        """Push the trainer's weights; ``new_version`` counts them as the next policy version. Without
        ``wait`` the update stays queued behind the requests already sent (a scheduler that overlaps
        training goes on meanwhile); the previous queued update is awaited first, long done by then,
        so its errors surface."""
        self.version += new_version
        futures = self.push(self.version)
        self.executor.get(self._queued)
        self._queued = [] if wait else futures
        if wait:
            self.executor.get(futures)

    def finish(self) -> None:
        """Wait for an update left queued (end of the run)."""
        self.executor.get(self._queued)
        self._queued = []

    def setup(self) -> None:
        """Called once after both roles' workers are set up (groups, rendezvous). Measures the bytes
        an update sends (every bucket of every sending rank; under LoRA, the adapters alone)."""
        self.bytes_per_update = _total_bytes(self.executor.get(self.trainer.call("weight_meta", self.bucket_bytes)))

    @abstractmethod
    def push(self, version: int) -> list:
        """Start one update (``version`` counts the updates); returns futures that finish when every
        inference worker has ended it and every training rank is done sending."""


class ObjectStoreSync(WeightSync):
    """Each rank's bucket list is one object; every inference worker gets all of them as arguments."""

    def push(self, version: int) -> list:
        per_rank = self.trainer.call("weight_bucket_list", self.bucket_bytes)
        loads = [self.executor.invoke(h, "update_weights", (version, *per_rank), {}) for h in self.infer.handles]
        return per_rank + loads


class CollectiveSync(WeightSync):
    """One broadcast group per sending rank, joined by every inference worker."""

    def setup(self) -> None:
        ex = self.executor
        metas = ex.get(self.trainer.call("weight_meta", self.bucket_bytes))
        self.bytes_per_update = _total_bytes(metas)
        self.senders = [i for i, meta in enumerate(metas) if meta]
        self.metas = [metas[i] for i in self.senders]
        devices = ex.get([ex.invoke(h, "device_type", (), {})
                          for h in [*(self.trainer.handles[i] for i in self.senders), *self.infer.handles]])
        backend = "nccl" if not self.colocated and all(d == "cuda" for d in devices) else "gloo"
        size = 1 + len(self.infer)
        joins = []
        for group, i in enumerate(self.senders):
            sender = self.trainer.handles[i]
            address = ex.get(ex.invoke(sender, "node_address", (), {}))
            members = [sender, *self.infer.handles]
            joins += [ex.invoke(h, "join_weight_group", (group, address, rank, size, backend), {})
                      for rank, h in enumerate(members)]
        ex.get(joins)

    def push(self, version: int) -> list:
        return (self.trainer.call("send_weights", self.bucket_bytes)
                + self.infer.call("receive_weights", version, self.metas))


class InProcessSync(WeightSync):
    """An inference worker in the trainer's process computes with the trainer's own parameter tensors
    where both strategies allow it (``hf`` on both sides, without LoRA): one copy of the weights in
    memory instead of two, and nothing to copy. The worker is either hosted by the trainer's worker
    (the hybrid engine on Ray) or, on the local executor, an object beside it in the driver. Safe
    because only rollouts that wait for the update qualify (config checks), in a process that runs
    one call at a time: the weights change in place only while the engine is idle, and each update
    re-points the engine at the trainer's current tensors. Elsewhere the trainer hands it the buckets
    in memory to copy."""

    def setup(self) -> None:
        ex = self.executor
        if [h.host if isinstance(h, Hosted) else None for h in self.infer.handles] == list(self.trainer.handles):
            # trainer worker i passes to the worker it hosts; the hand-over is one more call on the
            # trainer's own workers, which run it after the update
            self.receivers = [(host, [self.infer.role]) for host in self.trainer.handles]
            self.queues_behind_update = True
        elif ex.name == "local" and len(self.trainer) == 1:
            # the local executor has made every call by the time the next is sent: nothing to queue;
            # one call serves every inference worker, so a trainer that copies gathers its buckets once
            self.receivers = [(self.trainer.handles[0], list(self.infer.handles))]
        else:
            raise RollError(f"runtime.weight_sync: in_process needs every {self.infer.role} worker in a "
                            f"{self.trainer.role} worker's process (ray.hybrid_engine, or executor: local); use auto")
        if all(ex.get([ex.invoke(sender, "shares_weights_with", (to,), {}) for sender, to in self.receivers])):
            self.bytes_per_update = 0  # the engine reads the trainer's tensors: no byte moves
        else:
            super().setup()  # measures the buckets the trainer hands over

    def push(self, version: int) -> list:
        return [self.executor.invoke(sender, "pass_weights", (to, version, self.bucket_bytes), {})
                for sender, to in self.receivers]


class SharedMemoryUnavailable(RollError):
    """The workers are on different nodes, or ``/dev/shm`` cannot hold the buffers (containers often
    give it 64 MiB): ``auto`` falls back to ``collective``."""


class SharedMemorySync(WeightSync):
    """One shared-memory buffer per sending rank, mapped by that rank and every inference worker."""

    def setup(self) -> None:
        ex = self.executor
        metas = ex.get(self.trainer.call("weight_meta", self.bucket_bytes))
        self.bytes_per_update = _total_bytes(metas)
        self.senders = [i for i, meta in enumerate(metas) if meta]
        self.metas = [metas[i] for i in self.senders]
        senders = [self.trainer.handles[i] for i in self.senders]
        nodes = sorted({ip for ip, _ in ex.get([ex.invoke(h, "node_address", (), {})
                                                 for h in [*senders, *self.infer.handles]])})
        if len(nodes) > 1:
            raise SharedMemoryUnavailable(f"runtime.weight_sync: shared_memory needs actor_train's sending ranks "
                                          f"and every actor_infer worker on one node; they are on {nodes}")
        sizes = [distributed.buffer_layout(meta)[1] for meta in self.metas]
        free = shutil.disk_usage(SHARED_MEMORY).free
        if sum(sizes) > free:
            raise SharedMemoryUnavailable(f"runtime.weight_sync: shared_memory needs {sum(sizes) / 2**20:.0f} MiB "
                                          f"in {SHARED_MEMORY}, which has {free / 2**20:.0f} MiB free (a "
                                          f"container's --shm-size raises it)")
        token = uuid.uuid4().hex[:12]
        paths = [f"{SHARED_MEMORY}/roll-weights-{token}-{g}" for g in range(len(senders))]
        # the sender creates its buffer, the readers map it, then its name goes (the memory stays mapped)
        ex.get([ex.invoke(h, "map_weight_buffer", (g, path, size), {})
                for g, (h, path, size) in enumerate(zip(senders, paths, sizes))])
        ex.get([ex.invoke(h, "map_weight_buffer", (g, path, size), {})
                for g, (path, size) in enumerate(zip(paths, sizes)) for h in self.infer.handles])
        ex.get([ex.invoke(h, "unlink_weight_buffer", (path,), {}) for h, path in zip(senders, paths)])

    def push(self, version: int) -> list:
        self.finish()  # every reader is done with the last update before the buffers are written again
        written = self.trainer.call("write_weights", self.bucket_bytes)
        return written + self.infer.call("read_weights", version, self.metas, *(written[i] for i in self.senders))


def _total_bytes(metas_per_rank: list) -> int:
    return sum(distributed.bucket_bytes(meta) for rank in metas_per_rank for meta in rank)


def choose(config, overlaps_training: bool) -> str:
    """The backend ``runtime.weight_sync`` names (``auto``: see the module docstring)."""
    mode = config.runtime.weight_sync
    if mode != "auto":
        return mode
    if overlaps_training:
        return "object_store"
    if config.executor != "ray":  # every worker is an object in the driver's process
        return "object_store" if generates_while_training(config) else "in_process"
    if hybrid_engine(config):
        return "in_process"
    on_cpu = config.roles.actor_train.device_mapping is None and config.roles.actor_infer.device_mapping is None
    return "shared_memory" if on_cpu and config.ray.address is None else "collective"


def connect(config, executor: Executor, trainer: WorkerGroup, infer: WorkerGroup, overlaps_training: bool,
            plugins) -> WeightSync:
    """The chosen backend between ``trainer`` (actor_train) and ``infer`` (actor_infer), set up."""
    name = choose(config, overlaps_training)
    together = infer.role in colocated(config).get(trainer.role, set())
    sync = plugins.weight_syncs.get(name)(config, executor, trainer, infer, colocated=together)
    try:
        sync.setup()
    except SharedMemoryUnavailable as exc:
        if config.runtime.weight_sync != "auto":
            raise SharedMemoryUnavailable(f"{exc}; runtime.weight_sync: collective works anywhere") from None
        print(f"weight sync falls back to collective: {exc}", flush=True)
        sync = plugins.weight_syncs.get("collective")(config, executor, trainer, infer, colocated=together)
        sync.setup()
    return sync
