"""``torch.distributed`` for role workers: data-parallel groups and the weight-sync group.

* **Data parallelism.** The workers of a trained role form one default process group (gloo on
  CPU, nccl on GPU). Every rank computes its share of a mini-batch loss with *global* denominators
  (summed over ranks), so summing gradients over ranks gives exactly the gradient of the whole
  mini-batch on one worker: :func:`sum_gradients` for replicated models, FSDP2's reduce-scatter with
  a divide factor of 1 for sharded ones.
* **Weight sync.** Training rank 0 and every inference worker join a separate group built from its
  own TCP store (:class:`CollectiveGroup`), since those processes share no default group. Weights
  travel as flat byte buffers, one broadcast per bucket (:func:`pack_bucket` / :func:`unpack_bucket`),
  or, between processes of one node, through one shared-memory buffer per sending rank
  (:func:`shared_buffer`, :func:`buffer_layout`).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def node_address() -> tuple[str, int]:
    """This process's node IP and a free TCP port on it (for a group's rendezvous)."""
    try:
        import ray

        ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except ImportError:
        ip = "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return ip, s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_data_parallel(address: tuple[str, int] | None, rank: int, world: int, timeout_s: float = 1800) -> None:
    """Join this role's process group (no-op for one worker)."""
    if world == 1 or dist.is_initialized():
        return
    assert address is not None, "a group of several workers needs a rendezvous address"
    host, port = address
    dist.init_process_group(default_backend(), init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def ensure_process_group() -> None:
    """A ``torch.distributed`` group of one when this process has none (one worker, or the ``local``
    executor), so engines built on collectives (FSDP2, DeepSpeed, Megatron) run the same code path
    with one worker as with several."""
    if not dist.is_initialized():
        host, port = node_address()
        dist.init_process_group(default_backend(), init_method=f"tcp://{host}:{port}", rank=0, world_size=1)


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _alone(group=None) -> bool:
    """Whether this rank is the only one of ``group`` (None: of the whole role): nothing to reduce."""
    return rank_world()[1] == 1 or (group is not None and dist.get_world_size(group) == 1)


def barrier() -> None:
    """Wait until every rank of the role gets here; a worker alone waits for nothing."""
    if not _alone():
        dist.barrier()


def all_reduce_sum(values: list[float], group=None) -> list[float]:
    """Sum of each value over the data-parallel ranks: ``group`` (a strategy's data-parallel group
    under tensor or pipeline parallelism), else the whole role. The values themselves on one worker."""
    if _alone(group):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, group=group)
    return t.tolist()


def all_reduce_max(value: int, group=None) -> int:
    """The largest ``value`` over the data-parallel ranks (``group`` as in :func:`all_reduce_sum`)."""
    if _alone(group):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def sum_gradients(params) -> None:
    """All-reduce (sum) the gradients of a replicated model, coalesced into one buffer per dtype."""
    if rank_world()[1] == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in group])
        dist.all_reduce(flat)
        offset = 0
        for g in group:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _comm_device() -> torch.device:
    return torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")


class CollectiveGroup:
    """A process group of its own (TCP store + gloo or nccl), independent of the default group, so
    processes of different roles can broadcast to each other."""

    def __init__(self, address: tuple[str, int], rank: int, size: int, backend: str = "gloo",
                 timeout_s: float = 600, name: str = "weights"):
        host, port = address
        store = dist.TCPStore(host, port, size, is_master=(rank == 0), timeout=timedelta(seconds=timeout_s))
        prefixed = dist.PrefixStore(name, store)
        self._store = store  # the store must outlive the group
        self.rank, self.size, self.backend = rank, size, backend
        self.pg: Any
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size)  # type: ignore[call-arg]  # options has a default
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timedelta(seconds=timeout_s))

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self.pg.broadcast([tensor], opts).wait()
        return tensor


def bucketed(named_tensors, bucket_bytes: int, keep: bool = True):
    """``(name, tensor)`` pairs grouped into lists of about ``bucket_bytes`` each. The pairs are
    consumed to the end even when ``keep`` is False (a rank that sends nothing but must take part
    in the gathers that produce them), and then nothing is yielded."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        if not keep:
            continue
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def bucket_meta(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple, torch.dtype]]:
    return [(name, tuple(t.shape), t.dtype) for name, t in bucket]


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """One contiguous byte buffer holding every tensor of ``bucket`` (any dtypes)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])


def unpack_bucket(flat: torch.Tensor, meta: list[tuple[str, tuple, torch.dtype]]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`pack_bucket` (views into ``flat``)."""
    out, offset = [], 0
    for name, shape, dtype in meta:
        size = dtype.itemsize
        raw = flat[offset : offset + torch.Size(shape).numel() * size]
        if offset % size:  # a view to a wider dtype needs an aligned start
            raw = raw.clone()
        out.append((name, raw.view(dtype).view(shape)))
        offset += raw.numel()
    return out


def bucket_bytes(meta) -> int:
    """Bytes of one packed bucket described by ``meta`` (see :func:`bucket_meta`)."""
    return sum(torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype in meta)


BUFFER_ALIGN = 64  # every bucket of a shared buffer starts on a cache line, so its tensors view in place


def buffer_layout(metas: list) -> tuple[list[int], int]:
    """Where each bucket of ``metas`` (one :func:`bucket_meta` per bucket) starts in a shared weight
    buffer that holds them back to back, and the buffer's size in bytes."""
    offsets, end = [], 0
    for meta in metas:
        start = -(-end // BUFFER_ALIGN) * BUFFER_ALIGN
        offsets.append(start)
        end = start + bucket_bytes(meta)
    return offsets, end


def shared_buffer(path: str, nbytes: int) -> torch.Tensor:
    """``nbytes`` of memory shared by every process on this node that maps ``path`` (a file in
    ``/dev/shm``, created by the first to map it). The mapping outlives the file's name."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def pack_bucket_into(bucket: list[tuple[str, torch.Tensor]], out: torch.Tensor) -> None:
    """:func:`pack_bucket`'s layout written straight into ``out`` (a byte tensor on any device)."""
    offset = 0
    for _, t in bucket:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        out[offset : offset + raw.numel()].copy_(raw)
        offset += raw.numel()
