"""The actor objective every training strategy minimises, assembled from registered pieces.

    loss = agg(policy_loss) - entropy_coef * agg(entropy) + kl_loss_coef * agg(kl(actor, reference))

Living in the core (not in a strategy) means ``hf``, ``deepspeed``, ``megatron`` and ``fsdp2`` all
optimise exactly the same thing; a strategy only supplies log-probs and the backward pass.
"""

from __future__ import annotations

import torch

from roll_core.algorithms.losses import PolicyLossInput, aggregate
from roll_core.data import Batch


def actor_loss(
    log_prob: torch.Tensor,
    entropy: torch.Tensor | None,
    micro: Batch,
    config,
    *,
    global_tokens: float,
    global_seqs: float,
    plugins=None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss of one micro-batch (scaled for accumulation over the mini-batch) and its metrics."""
    from roll_core.plugins import get_plugins

    plugins = plugins or get_plugins()
    mask = micro["response_mask"].to(log_prob.dtype)
    agg = lambda x: aggregate(x, mask, config.loss_agg_mode, global_tokens=global_tokens,
                              global_seqs=global_seqs, max_response_length=mask.shape[-1])
    policy_loss_fn = plugins.policy_losses.get(config.policy_loss)
    pg_mat, metrics = policy_loss_fn(
        PolicyLossInput(log_prob, micro["old_log_probs"], micro["advantages"], mask), config
    )
    pg_loss = agg(pg_mat)
    loss = pg_loss
    metrics = {f"train/{k}": v for k, v in metrics.items()}
    metrics["train/pg_loss"] = pg_loss.item()
    if entropy is not None:
        ent = agg(entropy)
        metrics["train/entropy"] = ent.item()
        if config.entropy_coef:
            loss = loss - config.entropy_coef * ent
    if "ref_log_probs" in micro:
        kl_fn = plugins.kl_estimators.get(config.kl_estimator)
        kl = agg(kl_fn(log_prob, micro["ref_log_probs"]))
        metrics["train/kl"] = kl.item()
        if config.kl_loss_coef:
            loss = loss + config.kl_loss_coef * kl
    return loss, metrics
