"""Mixed precision for the torch strategies (``hf``, ``fsdp2``): ``strategy_options.precision``.

Why: a matrix product in bfloat16 runs about twice as fast as in float32 on GPUs and on CPUs with
bfloat16 instructions (AVX-512 BF16, AMX): ``benchmarks/bench_precision.py`` measures it on a
role's own work. ``bf16`` runs each forward pass under ``torch.autocast``: matrix products and
attention in bfloat16 (except on the CPU a decoding step's attention and that of a pass that
records gradients, which are faster in float32: :mod:`roll_core.strategies.float32_attention`), while the weights, their gradients and AdamW's
moments stay float32 (the master weights), softmax-like ops stay float32 (autocast's own lists),
and the log-probs, entropy and sampling are computed from logits cast back to float32. The
backward pass runs outside the autocast region, in the dtypes the forward recorded. Checkpoints and weight sync carry float32
weights, so a ``bf16`` inference role and an ``fp32`` trainer (or the reverse) work together.

This is autocast's kind of mixed precision, as TRL (``bf16=True``) runs it; DeepSpeed's ``bf16``
(``roll-deepspeed``'s ``precision``) keeps the weights themselves in bfloat16 with float32 copies
in the optimizer. Set per role::

    roll run roles.actor_train.strategy_options.precision=bf16 roles.actor_infer.strategy_options.precision=bf16
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


class TorchOptions(BaseModel):
    """``roles.<role>.strategy_options`` of the ``hf`` and ``fsdp2`` strategies."""

    model_config = ConfigDict(extra="forbid")

    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: forward passes under torch.autocast in bfloat16 (matrix products); "
        "weights, gradients and the optimizer stay float32")


def options(role_config) -> TorchOptions:
    """The role's validated options (``roll validate`` checked them before any worker started)."""
    return TorchOptions.model_validate(getattr(role_config, "strategy_options", None) or {})


class Autocasting:
    """For a strategy: the precision its forward passes autocast to, from ``strategy_options``. A
    subclass whose engine has options and a precision of its own (DeepSpeed's, which casts the model
    itself) overrides :meth:`autocast_precision`."""

    def autocast_precision(self, role_config) -> str:
        return options(role_config).precision


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The context a forward pass runs in: autocast to bfloat16 on ``device`` for ``bf16``, nothing for ``fp32``."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
