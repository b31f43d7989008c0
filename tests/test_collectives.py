"""``runtime/distributed.py`` on its own: the data-parallel reductions and the gradient sum over two
gloo processes, a weight-sync group's broadcast, and the byte layout weights travel in.

The pipelines reach all of it through Ray (``test_distributed.py``, ``test_weight_sync.py``) in
minutes; here two plain processes take a few seconds, with values a test can work out by hand."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from roll_core.runtime import distributed


def _two_ranks(rank: int, ports: tuple[int, int], out_dir: str) -> None:
    """Rank ``rank`` of 2: every helper once, what it returned saved for the test."""
    torch.set_num_threads(1)
    distributed.init_data_parallel(("127.0.0.1", ports[0]), rank, 2, timeout_s=60)
    got: dict = {"rank_world": distributed.rank_world()}
    got["sum"] = distributed.all_reduce_sum([1e15 + rank, 0.25 * rank])  # 2e15 + 1: exact in float64 only
    got["max"] = distributed.all_reduce_max(7 if rank else 3)
    alone = dist.new_group([0]), dist.new_group([1])  # every rank creates every group, in order
    got["sum_both"] = distributed.all_reduce_sum([1.0 + rank], group=dist.new_group([0, 1]))
    got["sum_alone"] = distributed.all_reduce_sum([1.0 + rank], group=alone[rank])
    got["max_alone"] = distributed.all_reduce_max(7 if rank else 3, group=alone[rank])
    # a replicated model's gradients: two dtypes, one parameter without a gradient
    params = [torch.zeros(2, 3, requires_grad=True), torch.zeros(4, dtype=torch.float64, requires_grad=True),
              torch.zeros(1, requires_grad=True), torch.zeros(5, requires_grad=True)]
    params[0].grad = torch.arange(6.0).view(2, 3) * (rank + 1)
    params[1].grad = torch.full((4,), 0.5 + rank, dtype=torch.float64)
    params[3].grad = torch.ones(5) * 10 ** rank
    distributed.sum_gradients(params)
    got["grads"] = [p.grad for p in params]
    # the weight-sync group: its own store, independent of the default group
    group = distributed.CollectiveGroup(("127.0.0.1", ports[1]), rank, 2, timeout_s=60)
    weights = torch.arange(5.0) if rank == 0 else torch.zeros(5)
    got["broadcast"] = group.broadcast(weights).clone()
    got["from_rank_1"] = group.broadcast(torch.tensor([float(rank)]), root=1).clone()
    torch.save(got, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


def test_two_ranks_reduce_sum_gradients_and_broadcast(tmp_path):
    ports = (distributed.node_address()[1], distributed.node_address()[1])
    mp.spawn(_two_ranks, args=(ports, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in (0, 1)]
    for rank, got in enumerate(ranks):
        assert got["rank_world"] == (rank, 2)
        assert got["sum"] == [2e15 + 1, 0.25] and got["max"] == 7 and got["sum_both"] == [3.0]
        assert got["sum_alone"] == [1.0 + rank] and got["max_alone"] == (7 if rank else 3)  # a group of one
        grads = got["grads"]
        torch.testing.assert_close(grads[0], torch.arange(6.0).view(2, 3) * 3, rtol=0, atol=0)
        assert grads[1].dtype == torch.float64 and grads[1].tolist() == [2.0] * 4
        assert grads[2] is None and grads[3].tolist() == [11.0] * 5
        assert got["broadcast"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert got["from_rank_1"].tolist() == [1.0]


def test_one_worker_needs_no_group_and_reduces_nothing():
    assert not dist.is_initialized()
    distributed.init_data_parallel(None, 0, 1)  # no rendezvous for one worker
    assert not dist.is_initialized() and distributed.rank_world() == (0, 1)
    assert distributed.all_reduce_sum([2.5, -1.0]) == [2.5, -1.0] and distributed.all_reduce_max(4) == 4
    grad = torch.ones(3)
    param = torch.zeros(3, requires_grad=True)
    param.grad = grad
    distributed.sum_gradients([param])
    assert param.grad is grad and grad.tolist() == [1.0] * 3


def test_buckets_of_a_byte_budget_and_a_rank_that_keeps_none():
    tensors = [(f"w{i}", torch.zeros(n)) for i, n in enumerate([2, 2, 1, 4, 1])]  # 8, 8, 4, 16, 4 bytes
    buckets = list(distributed.bucketed(iter(tensors), 16))
    assert [[name for name, _ in b] for b in buckets] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert list(distributed.bucketed(iter(tensors), 1 << 20)) == [tensors]
    consumed = []

    def gathered():  # a rank that sends nothing still takes part in every gather
        for pair in tensors:
            consumed.append(pair[0])
            yield pair

    assert list(distributed.bucketed(gathered(), 16, keep=False)) == []
    assert consumed == ["w0", "w1", "w2", "w3", "w4"]


def test_a_packed_bucket_unpacks_to_its_tensors_whatever_their_dtypes():
    bucket = [("mask", torch.tensor([1, 0, 1], dtype=torch.uint8)),  # 3 bytes: the next start is unaligned
              ("w", torch.arange(6.0).view(2, 3).t()),  # not contiguous
              ("h", torch.tensor([1.5, -2.0], dtype=torch.bfloat16)),
              ("step", torch.tensor([7], dtype=torch.int64))]
    meta = distributed.bucket_meta(bucket)
    assert meta[1] == ("w", (3, 2), torch.float32)
    flat = distributed.pack_bucket(bucket)
    assert flat.dtype == torch.uint8 and flat.numel() == distributed.bucket_bytes(meta) == 3 + 24 + 4 + 8
    unpacked = distributed.unpack_bucket(flat, meta)
    assert len(unpacked) == len(bucket)
    for (name, tensor), (got_name, got) in zip(bucket, unpacked):
        assert got_name == name and got.dtype == tensor.dtype
        torch.testing.assert_close(got, tensor, rtol=0, atol=0)
