"""Whole values of parameters that a sharded trainer splits across its ranks.

A replicated trainer (``hf``) holds every parameter whole on every rank. ``fsdp2`` holds a DTensor
per parameter, each rank a shard of it; DeepSpeed's ZeRO-3 (roll-deepspeed) keeps each rank's
partition beside an empty placeholder. What reads or writes a parameter's whole value outside the
forward pass (LoRA's merge, fold and adapter checkpoints, a sharded trainer's export) goes through a
:class:`WholeParameters`: :data:`TENSORS` serves plain tensors and DTensors, and a backend whose
parameters are partitioned another way passes a subclass. Reads and writes of a sharded parameter
are collectives: every rank makes the same calls in the same order.
"""

from __future__ import annotations

import torch


class WholeParameters:
    """Plain tensors as they are; DTensors gathered from, and written back as, their shards."""

    def read(self, param: torch.Tensor) -> torch.Tensor:
        """The parameter's whole value, detached (a DTensor's shards gathered from every rank)."""
        from torch.distributed.tensor import DTensor

        value = param.detach()
        return value.full_tensor() if isinstance(value, DTensor) else value

    def write(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Set the parameter's whole value to ``value`` (a whole tensor, the same on every rank, cast to
        the parameter's dtype): a DTensor keeps this rank's shard of it."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        value = value.to(param.dtype)
        if isinstance(param, DTensor):
            value = distribute_tensor(value, param.device_mesh, param.placements)
        with torch.no_grad():
            param.copy_(value)

    def shape(self, param: torch.Tensor) -> torch.Size:
        """The whole value's shape (a DTensor's ``shape`` is the global one)."""
        return param.shape


TENSORS = WholeParameters()
