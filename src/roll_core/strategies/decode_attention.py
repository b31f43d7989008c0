"""A decoding step's attention on the CPU under bf16 autocast: in float32, over a float32 KV cache.

Why: with ``strategy_options.precision: bf16`` the sampler runs under ``torch.autocast("cpu",
bfloat16)`` (:mod:`roll_core.strategies.precision`), and ``scaled_dot_product_attention`` is on
autocast's bfloat16 list. The keys come out of the rotary embedding in float32 (its tables are
float32) while the values come out of their projection in bfloat16, so at every decoding step
autocast cast the whole cached keys to bfloat16, then ran torch's CPU kernel for one query in
bfloat16, which is slower than its float32 kernel. On the 95M model of ``benchmarks/large_model.py``
(64 rows, 64 new tokens, 2 cores) torch's profiler put attention at 1.2 s of bf16 generation's
4.9 s (0.5 s in float32), and copies, most of them those casts, at 0.5 s more. Here attention took
0.6 s and copies 0.3 s; ``benchmarks/bench_decode_attention.py`` measures the tokens per second
side by side: 1.15x at 95M, 1.11x on the quickstart's model, the log-probs as near to float32's.

What it does, on the CPU under autocast only:

* the sampler keeps the cache's keys and values in float32 (:func:`cache_dtype`; each step writes
  one position, cast on the way in), where it would have held float32 keys and bfloat16 values;
* a decoding step (one query per row) attends in float32 with autocast off (:func:`attend`): no cast
  of the cache, the faster kernel, and attention at least as precise as autocast's. The matrix
  products around it stay in bfloat16. Training passes and the prompt's prefill are unchanged.

It is part of the attention implementation that :mod:`roll_core.strategies.packed_attention`
registers, which a ``bf16`` role on the CPU adopts when it loads its model. On a GPU autocast's
bfloat16 kernels are fast, and nothing here applies.
"""

from __future__ import annotations

import torch

DEVICE_TYPES = ("cpu",)  # where a decoding step under autocast attends in float32


def applies(device: torch.device) -> bool:
    """Whether a decoding step on ``device`` attends here now: a device of ``DEVICE_TYPES`` with
    autocast on (the role's precision is ``bf16``)."""
    return device.type in DEVICE_TYPES and torch.is_autocast_enabled(device.type)


def cache_dtype(model, device: torch.device) -> torch.dtype | None:
    """The dtype the sampler's KV cache should hold for ``model`` on ``device``: float32 where its
    decoding steps attend here, else None (keys and values as the layers give them)."""
    from roll_core.strategies.packed_attention import ATTENTION
    from roll_core.strategies.packing import model_config

    adopted = getattr(model_config(model), "_attn_implementation", None) == ATTENTION
    return torch.float32 if adopted and applies(device) else None


def attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
           **kwargs) -> tuple[torch.Tensor, None]:
    """``transformers``' attention-function signature (``query`` ``[N, H, 1, D]``, ``key`` and ``value``
    ``[N, H_kv, T, D]``): ``sdpa`` in float32 with autocast off. Returns ``[N, 1, H, D]`` in float32
    (the output projection that follows casts it back under autocast) and no weights."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with torch.autocast(query.device.type, enabled=False):
        return sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
