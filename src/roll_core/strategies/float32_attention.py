"""Attention on the CPU under bf16 autocast, in float32 where torch's float32 kernels are the faster:
decoding steps, over a float32 KV cache, and passes that record gradients.

Why: with ``strategy_options.precision: bf16`` a role's forward passes run under
``torch.autocast("cpu", bfloat16)`` (:mod:`roll_core.strategies.precision`), and
``scaled_dot_product_attention`` is on autocast's bfloat16 list. The keys come out of the rotary
embedding in float32 (its tables are float32), the values out of their projection in bfloat16, so
autocast casts them and runs torch's bfloat16 CPU kernels, which are the slower ones in two places:

* a decoding step: one query against the whole cache, which autocast cast to bfloat16 at every step.
  On the 95M model of ``benchmarks/large_model.py`` (64 rows, 64 new tokens, 2 cores) torch's
  profiler put attention at 1.2 s of bf16 generation's 4.9 s (0.5 s in float32), and copies, most
  of them those casts, at 0.5 s more;
* a pass that records gradients (the update): the bfloat16 backward kernel. In one update of the
  same model (one pass over 64 samples of up to 64 tokens, by pieces) attention's backward took
  0.50 s of 6.9 s, the most after the matrix products; at the pieces' shapes float32's forward and
  backward were 1.7-2.3x faster than autocast's (3.4x at the quickstart model's), level on dense
  rows of 458 positions.

Forward passes without gradients (the prompt's prefill, log-probs for the loss) keep autocast's
attention: there its bfloat16 kernel was 1.01-1.28x the faster. ``benchmarks/bench_float32_attention.py``
measures both sides against autocast's attention: generation 1.15x tokens/s and the update 1.08x
faster at 95M, 1.18x and 1.34x on the quickstart's model, on a 2-core Zen 4 EPYC.

What it does, on a device of ``DEVICE_TYPES`` under autocast only:

* the sampler keeps the cache's keys and values in float32 (:func:`cache_dtype`; each step writes one
  position, cast on the way in), where it would have held float32 keys and bfloat16 values;
* a decoding step or a pass that records gradients attends in float32 with autocast off
  (:func:`attend`): no casts of the keys, the faster kernels, and attention at least as precise as
  autocast's. The matrix products around it stay in bfloat16 (the output projection casts what it
  returns).

It is part of the attention implementation that :mod:`roll_core.strategies.packed_attention`
registers (piece by piece or dense alike), which a ``bf16`` role on the CPU adopts when it loads its
model (:func:`adopt`). On a GPU autocast's bfloat16 kernels are fast, and nothing here applies.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

DEVICE_TYPES = ("cpu",)  # where attention under autocast may run in float32


def _autocasting(device: torch.device) -> bool:
    return device.type in DEVICE_TYPES and torch.is_autocast_enabled(device.type)


def applies(query: torch.Tensor) -> bool:
    """Whether attention over ``query`` ``[N, H, Q, D]`` runs here: on a device of ``DEVICE_TYPES``
    under autocast (the role's precision is ``bf16``), for a decoding step (one query) or in a pass
    that records gradients."""
    return _autocasting(query.device) and (query.shape[2] == 1 or torch.is_grad_enabled())


def adopt(model, role_precision: str, device: torch.device) -> None:
    """For a role whose model loads on ``device``: a ``bf16`` role on a device of ``DEVICE_TYPES``
    switches ``model`` to roll's attention implementation, whose decoding steps and passes that
    record gradients attend here (:func:`roll_core.strategies.packed_attention.adopt`)."""
    from roll_core.strategies import packed_attention

    if role_precision == "bf16" and device.type in DEVICE_TYPES:
        packed_attention.adopt(model, model.config)


def cache_dtype(model, device: torch.device) -> torch.dtype | None:
    """The dtype the sampler's KV cache should hold for ``model`` on ``device``: float32 where its
    decoding steps attend here, else None (keys and values as the layers give them)."""
    from roll_core.strategies.packed_attention import ATTENTION
    from roll_core.strategies.packing import model_config

    adopted = getattr(model_config(model), "_attn_implementation", None) == ATTENTION
    return torch.float32 if adopted and _autocasting(device) else None


def attend(attention: Callable[..., Any], module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
           value: torch.Tensor) -> Any:
    """``attention(module, query, key, value)`` with the three in float32 and autocast off; what it
    returns (``[N, Q, H, D]`` in float32, with ``transformers``' attention functions) is cast back to
    bfloat16 by the output projection that follows under autocast."""
    with torch.autocast(query.device.type, enabled=False):
        return attention(module, query.float(), key.float(), value.float())
