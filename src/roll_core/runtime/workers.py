"""Strategy workers. One worker hosts one strategy for one role (rewards have their own worker,
:mod:`roll_core.runtime.reward_worker`, which starts without torch).

Workers are plain classes: the ``local`` executor instantiates them in the driver, the ``ray``
executor wraps them in ``ray.remote``. A worker looks its strategy up in *its own process's*
plugin registries, so whatever is installed (entry points) is available inside Ray workers too.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from roll_core.errors import RollError
from roll_core.plugins import get_plugins
from roll_core.runtime import distributed, host_memory
from roll_core.runtime.worker_base import Worker, bind_devices
from roll_core.strategies import cpu_matmul, cudnn_attention, lora


class _StrategyWorker(Worker):
    """Hosts one strategy of kind :attr:`kind` (a ``{kind}_strategies`` registry name) for one role.

    Built in two calls: the constructor binds devices, :meth:`setup` joins the role's
    data-parallel group (all workers of the role at once) and then builds the strategy, which may
    shard its model over that group. Each kind's worker exposes that kind's methods only, so a
    pipeline that calls a trained role's method on an inference role fails at the call, by name."""

    kind: str

    def __init__(self, role: str, model_path: str, role_config, run_config, seed: int, devices=None):
        bind_devices(devices)
        torch.set_num_threads(run_config.torch_threads)  # a role's own count applies during RL steps only
        cpu_matmul.configure(run_config.runtime.cpu_matmul, run_config.runtime.pack_decoding_weights)
        cudnn_attention.configure(run_config.runtime.cudnn_attention)
        if devices is None and run_config.runtime.reuse_freed_memory:  # computes on CPU
            host_memory.keep_freed_memory()
        self.role = role
        self._args = (model_path, role_config, run_config, seed)
        self.strategy: Any = None  # built by setup()

    def setup(self, address: tuple[str, int] | None = None, rank: int = 0, world: int = 1) -> int:
        """Join the role's group, build the strategy; returns this worker's data-parallel rank."""
        model_path, role_config, run_config, seed = self._args
        distributed.init_data_parallel(address, rank, world, run_config.runtime.worker_timeout_s)
        cls = get_plugins().registry(f"{self.kind}_strategies").get(role_config.strategy)
        self.strategy = cls(model_path, role_config, seed)  # its role's section of the config only
        layout = getattr(self.strategy, "data_parallel", None)
        return layout()[0] if layout is not None else 0

    def placement(self) -> dict:
        """Also the kernel its model's linear layers use on CPU (``runtime.cpu_matmul`` as resolved on
        this machine) and whether its attention may use cuDNN's kernel on a GPU (``runtime.cudnn_attention``)."""
        return {**super().placement(), "cpu_matmul": "onednn" if cpu_matmul.uses_onednn() else "torch",
                "cudnn_attention": cudnn_attention.enabled()}

    def node_address(self) -> tuple[str, int]:
        return distributed.node_address()

    def device_type(self) -> str:
        return self.strategy.device.type if hasattr(self.strategy, "device") else "cpu"

    def set_threads(self, n: int) -> None:
        """Intra-op threads from now on (the pipeline switches a role's count between phases)."""
        torch.set_num_threads(n)

    def close(self) -> None:
        """Release the strategy (:meth:`roll_core.strategy.Colocatable.close`: an engine's threads and
        memory) and drop it: the local executor's stop, and every executor's at a run's end."""
        super().close()
        strategy, self.strategy = self.strategy, _Closed(self.role)
        if not isinstance(strategy, _Closed):  # set in __init__: a second close finds the stand-in
            strategy.close()

    # -- colocation -----------------------------------------------------------------------------
    def offload(self) -> None:
        self.strategy.offload()

    def reload(self) -> None:
        self.strategy.reload()


class _Closed:
    """A closed worker's strategy: what reaches for it learns why it is gone, not that ``None`` has
    no such attribute."""

    def __init__(self, role: str):
        self.role = role

    def __getattr__(self, name: str):
        raise RollError(f"{self.role}: this worker was closed when its executor stopped it (the run ended, or "
                        f"the worker was replaced); its strategy's '{name}' is gone with it")


class _WeightGroupMember:
    """A worker in the broadcast groups, or sharing the memory buffers, of weight sync
    (:mod:`roll_core.runtime.weight_sync`). Both are keyed by group: one per sending training rank."""

    _args: tuple
    weight_groups: dict[int, distributed.CollectiveGroup]
    weight_buffers: dict[int, torch.Tensor]

    def map_weight_buffer(self, group: int, path: str, nbytes: int) -> None:
        """Map shared buffer ``group`` (a file in ``/dev/shm`` on this node; the first to map creates it)."""
        self.weight_buffers[group] = distributed.shared_buffer(path, nbytes)

    def unlink_weight_buffer(self, path: str) -> None:
        """Remove the buffer's name once every member has mapped it: the memory lives on in the
        mappings and is freed with the last process, so no crash leaves a file behind."""
        os.unlink(path)

    def join_weight_group(self, group: int, address: tuple[str, int], rank: int, size: int, backend: str) -> None:
        """Join broadcast group ``group`` (one per sending training rank; rank 0 is the sender)."""
        timeout = self._args[2].runtime.worker_timeout_s
        self.weight_groups[group] = distributed.CollectiveGroup(address, rank, size, backend, timeout_s=timeout,
                                                                name=f"weights-{group}")


class _TrainedWorker(_StrategyWorker):
    """What every trained role does: the core update loop and checkpoints."""

    def update(self, batch, loss_fn, spec) -> dict:
        """The core update loop (:func:`roll_core.training.update`) on this rank's share ``batch``,
        with the loss function and :class:`~roll_core.training.UpdateSpec` the driver resolved."""
        from roll_core.training import update

        return update(self.strategy, batch, loss_fn, spec)

    def save_checkpoint(self, path: str) -> None:
        self.strategy.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.strategy.load_checkpoint(path)


class TrainWorker(_TrainedWorker, _WeightGroupMember):
    """A trained policy (actor_train, a :class:`~roll_core.strategy.TrainStrategy`): updates, its
    log-probs, LoRA adapters, and sending weights to the inference engines."""

    kind = "train"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight_groups, self.weight_buffers = {}, {}

    def compute_log_probs(self, batch, temperature: float, distribution: bool = False):
        return self.strategy.compute_log_probs(batch, temperature, distribution)

    def base_log_probs(self, batch, temperature: float, distribution: bool = False):
        """Log-probs under the base model, its LoRA adapters disabled (the reference of a LoRA run,
        served by the trained role's workers)."""
        return self.strategy.base_log_probs(batch, temperature, distribution)

    def fold_adapters(self, base_path: str) -> None:
        """LoRA: fold the adapters into the base, which ``base_path`` holds on disk."""
        self.strategy.fold_adapters(base_path)

    def export_model(self, path: str) -> None:
        """The trained policy as a plain Hugging Face model directory (LoRA adapters merged)."""
        self.strategy.export_model(path)

    # Training strategies may gather sharded weights with collectives, so every training rank
    # iterates its buckets; the ranks that own weights send them.
    def weight_bucket_list(self, bucket_bytes: int) -> list:
        return list(self.strategy.weight_buckets(bucket_bytes))

    def weight_meta(self, bucket_bytes: int) -> list:
        """Names, shapes and dtypes of each bucket this rank sends (what receivers need to unpack
        broadcasts); empty on ranks that send nothing."""
        return [distributed.bucket_meta(b) for b in self.strategy.weight_buckets(bucket_bytes)]

    def send_weights(self, bucket_bytes: int) -> int:
        """Broadcast every bucket this rank owns to its group; bytes sent."""
        sent = 0
        for bucket in self.strategy.weight_buckets(bucket_bytes):
            (group,) = self.weight_groups.values()  # a sender belongs to its own group only
            flat = distributed.pack_bucket(bucket)
            if group.backend == "nccl":
                flat = flat.cuda()
            group.broadcast(flat)
            sent += flat.numel()
        return sent

    def pass_weights(self, to: list, version: int, bucket_bytes: int) -> int:
        """One update of the inference workers in this process, ``to``: each the role of one this
        worker hosts (the hybrid engine) or the worker itself (the local executor). Each computes with
        this worker's own parameter tensors where both strategies allow (``shared_parameters``,
        ``share``; then nothing is copied), else the buckets are handed over in memory, gathered once
        for all that copy. Returns the tensors copied."""
        live, buckets, copied = self.strategy.shared_parameters(), None, 0
        for receiver in map(self._in_process, to):
            if live is not None and receiver.share_weights(version, live):
                continue
            if buckets is None:
                buckets = self.weight_bucket_list(bucket_bytes)
            copied += receiver.update_weights(version, buckets)
        return copied

    def shares_weights_with(self, to: list) -> bool:
        """Whether :meth:`pass_weights` shares this worker's tensors with every worker of ``to``
        (asked before any update; nothing changes)."""
        live = self.strategy.shared_parameters()
        return live is not None and all(self._in_process(t).can_share_weights(live) for t in to)

    def _in_process(self, to):
        return self.hosted[to] if isinstance(to, str) else to

    def write_weights(self, bucket_bytes: int) -> int:
        """Write every bucket this rank owns into its shared buffer (laid out by
        :func:`~roll_core.runtime.distributed.buffer_layout`); bytes written."""
        buckets = list(self.strategy.weight_buckets(bucket_bytes))
        if not buckets:
            return 0
        (buffer,) = self.weight_buffers.values()  # a sender maps its own buffer only
        metas = [distributed.bucket_meta(b) for b in buckets]
        offsets, _ = distributed.buffer_layout(metas)
        for bucket, start in zip(buckets, offsets):
            distributed.pack_bucket_into(bucket, buffer[start:])
        return sum(map(distributed.bucket_bytes, metas))


class CriticWorker(_TrainedWorker):
    """PPO's value model (a :class:`~roll_core.strategy.CriticStrategy`)."""

    kind = "critic"

    def compute_values(self, batch):
        return self.strategy.compute_values(batch)


class InferWorker(_StrategyWorker, _WeightGroupMember):
    """An inference engine (actor_infer, a reference or a teacher: an
    :class:`~roll_core.strategy.InferStrategy`): generation, log-probs, its sampling RNG, and
    receiving weight updates."""

    kind = "infer"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight_groups, self.weight_buffers = {}, {}
        self.merger: lora.AdapterMerger | None = None  # once LoRA adapters arrive

    def generate(self, batch, **sampling):
        return self.strategy.generate(batch, **sampling)

    def compute_log_probs(self, batch, temperature: float, distribution: bool = False):
        return self.strategy.compute_log_probs(batch, temperature, distribution)

    def top_k_log_probs(self, batch, temperature: float, k: int):
        """The ``k`` most likely tokens at every response position, ``(log-probs, token ids)``
        ``[B, R, k]`` each, at ``temperature``: what a distillation teacher sends instead of its
        whole vocabulary."""
        return self.strategy.compute_log_probs(batch, temperature, distribution=True).topk(k, dim=-1)

    def rng_state(self):
        return self.strategy.rng_state()

    def set_rng_state(self, state) -> None:
        self.strategy.set_rng_state(state)

    def rebase_adapters(self, base_path: str) -> None:
        """LoRA: merge received adapters onto ``base_path``'s weights from now on."""
        self.merger = lora.AdapterMerger(base_path)

    def _load(self, bucket: list) -> None:
        """One received bucket into the engine; LoRA adapters are merged onto the base weights first
        (:class:`~roll_core.strategies.lora.AdapterMerger`, created by the first sync that has any)."""
        if self.merger is None and any(lora.is_adapter(name) for name, _ in bucket):
            self.merger = lora.AdapterMerger(self._args[0])
        if self.merger is not None:
            bucket = self.merger.merge(bucket)
        if bucket:
            self.strategy.load(bucket)

    def _end_update(self) -> None:
        if self.merger is not None:
            self.merger.finish()
        self.strategy.end_update()

    def update_weights(self, version: int, *per_rank: list) -> int:
        """One update from buckets passed in (``per_rank``: each training rank's bucket list); tensors received."""
        self.strategy.begin_update(version)
        loaded = 0
        for buckets in per_rank:
            for bucket in buckets:
                self._load(bucket)
                loaded += len(bucket)
        self._end_update()
        return loaded

    def can_share_weights(self, parameters: dict) -> bool:
        return self.merger is None and self.strategy.can_share(parameters)  # a merger: adapters arrive

    def share_weights(self, version: int, parameters: dict) -> bool:
        """One update by taking a trainer's tensors in this process as the weights (the hybrid
        engine); False, with nothing changed, where the engine keeps its own copy."""
        if not self.can_share_weights(parameters):
            return False
        self.strategy.begin_update(version)
        self.strategy.share(parameters)
        self._end_update()
        return True

    def receive_weights(self, version: int, metas: list) -> int:
        """One update from broadcasts: ``metas[g]`` describes the buckets group ``g``'s sender sends; bytes."""
        self.strategy.begin_update(version)
        received = 0
        for g, meta in enumerate(metas):
            group = self.weight_groups[g]
            device = "cuda" if group.backend == "nccl" else "cpu"
            for bucket_meta in meta:
                flat = torch.empty(distributed.bucket_bytes(bucket_meta), dtype=torch.uint8, device=device)
                group.broadcast(flat)
                self._load(distributed.unpack_bucket(flat, bucket_meta))
                received += flat.numel()
        self._end_update()
        return received

    def read_weights(self, version: int, metas: list, *written: int) -> int:
        """One update from the shared buffers: ``metas[g]`` describes what group ``g``'s sender wrote.
        ``written`` are the senders' results, so on Ray this call runs once they are done; bytes."""
        self.strategy.begin_update(version)
        received = 0
        for g, meta in enumerate(metas):
            offsets, _ = distributed.buffer_layout(meta)
            for start, bucket_meta in zip(offsets, meta):
                size = distributed.bucket_bytes(bucket_meta)
                self._load(distributed.unpack_bucket(self.weight_buffers[g][start : start + size], bucket_meta))
                received += size
        self._end_update()
        return received


STRATEGY_WORKERS: dict[str, type[_StrategyWorker]] = {w.kind: w for w in (TrainWorker, InferWorker, CriticWorker)}
"""The worker class of each strategy kind (:data:`roll_core.plugins.STRATEGY_KINDS`)."""
