"""Weight sync: the trained policy's weights reach the inference engines after every update.

The protocol, as an inference strategy sees it (:class:`roll_core.strategy.InferStrategy`)::

    begin_update(version)     an engine may pause generation here
    load(bucket)              for every bucket: [(Hugging Face parameter name, tensor), ...]
    end_update()              every bucket is in: reset the prefix cache, resume

On the training side every rank iterates ``weight_buckets`` (sharded strategies gather with
collectives there) and yields the buckets of the weights it owns: one rank of replicated data
parallelism, every pipeline stage's first rank once stages split the layers. A backend moves those
buckets; backends are a registered plugin kind (``roll_register_weight_syncs``), chosen with
``runtime.weight_sync`` (``auto``: ``collective`` on Ray for schedulers that wait for the update,
``object_store`` otherwise):

* ``collective``: each sending rank and every inference worker form a ``torch.distributed`` group of
  their own and each bucket is one broadcast (nccl when both sides are on GPUs and not colocated,
  gloo otherwise);
* ``object_store``: the buckets travel as call arguments (Ray's object store; memory when local).

A backend is constructed as ``cls(config, executor, trainer_group, infer_group, colocated)`` and
implements :meth:`WeightSync.push`; pipelines call :meth:`WeightSync.update`, which counts versions
and may leave an update queued. The update is ordered on each inference worker like any other call:
requests sent before it finish with the old weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from roll_core.runtime.executor import Executor, WorkerGroup


class WeightSync(ABC):
    """Moves the trainer's weight buckets to every inference worker."""

    def __init__(self, config, executor: Executor, trainer: WorkerGroup, infer: WorkerGroup, colocated: bool):
        self.config, self.executor = config, executor
        self.trainer, self.infer, self.colocated = trainer, infer, colocated
        self.bucket_bytes = int(config.runtime.weight_bucket_mb * 2**20)
        self.version = 0  # policy updates pushed so far
        self.bytes_per_update = 0  # what the training ranks send each update (weight_sync/bytes), set by setup
        self._queued: list = []  # futures of the update left queued behind running requests

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


def _total_bytes(metas_per_rank: list) -> int:
    from roll_core.runtime.distributed import bucket_bytes

    return sum(bucket_bytes(meta) for rank in metas_per_rank for meta in rank)


def choose(config, overlaps_training: bool) -> str:
    """The backend ``runtime.weight_sync`` names (``auto``: see the module docstring)."""
    mode = config.runtime.weight_sync
    if mode == "auto":
        return "collective" if config.executor == "ray" and not overlaps_training else "object_store"
    return mode


def connect(config, executor: Executor, trainer: WorkerGroup, infer: WorkerGroup, overlaps_training: bool,
            plugins) -> WeightSync:
    """The chosen backend between ``trainer`` (actor_train) and ``infer`` (actor_infer), set up."""
    from roll_core.runtime.placement import colocated

    backend = plugins.weight_syncs.get(choose(config, overlaps_training))
    sync = backend(config, executor, trainer, infer, colocated=infer.role in colocated(config).get(trainer.role, set()))
    sync.setup()
    return sync
