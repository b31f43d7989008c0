"""Policy losses and loss aggregation.

A policy loss is ``fn(inputs: PolicyLossInput, config: AlgorithmConfig) -> (loss [B, R], metrics)``:
a per-token loss that :func:`aggregate` reduces according to ``config.loss_agg_mode``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyLossInput:
    log_prob: torch.Tensor  # [B, R] under the current weights (requires grad)
    old_log_prob: torch.Tensor  # [B, R] under the weights that generated the batch
    advantages: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R]


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def ppo_clip(inputs: PolicyLossInput, config) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), asymmetric clip range.

        ratio = exp(log_prob - old_log_prob)
        loss  = -min(ratio * A, clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high) * A)

    ``clip_ratio_high > clip_ratio_low`` is DAPO's clip-higher (arXiv:2503.14476).
    Shapes: all inputs ``[B, R]``; returns the loss ``[B, R]`` and scalar metrics.
    """
    log_ratio = (inputs.log_prob - inputs.old_log_prob).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    adv = inputs.advantages
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    mask = inputs.response_mask
    metrics = {
        "clip_frac": _masked_mean((clipped < unclipped).float(), mask),
        "approx_kl": _masked_mean(-log_ratio.detach(), mask),
    }
    return loss, metrics


def vanilla_pg(inputs: PolicyLossInput, config) -> tuple[torch.Tensor, dict[str, float]]:
    """Plain policy gradient (Williams 1992): ``loss = -A * log_prob``. Shapes as :func:`ppo_clip`."""
    return -inputs.advantages * inputs.log_prob, {}


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    max_response_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, R]`` to a scalar.

    ``global_tokens`` / ``global_seqs`` are the counts over the whole mini-batch (all micro-batches,
    all data-parallel ranks). Passing them makes the sum of micro-batch losses equal the loss of the
    full batch, so gradient accumulation does not change the gradient. Without them the counts of
    this micro-batch are used.

    * ``token-mean``:             sum(loss * mask) / tokens                       (DAPO)
    * ``seq-mean-token-sum``:     sum_seq(sum_tok loss) / seqs
    * ``seq-mean-token-mean``:    sum_seq(mean_tok loss) / seqs                   (original GRPO)
    * ``seq-mean-token-sum-norm``: sum(loss * mask) / (seqs * max_response_length) (Dr. GRPO)
    """
    tokens = global_tokens if global_tokens is not None else float(mask.sum())
    seqs = global_seqs if global_seqs is not None else float(mask.shape[0])
    masked = loss * mask
    if mode == "token-mean":
        return masked.sum() / max(tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum(-1).sum() / max(seqs, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / max(seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        horizon = max_response_length or mask.shape[-1]
        return masked.sum() / max(seqs * horizon, 1.0)
    raise ValueError(f"unknown loss_agg_mode '{mode}'")
