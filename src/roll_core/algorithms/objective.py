"""The actor objective every training strategy minimises, assembled from registered pieces.

    loss = agg(policy_loss) - entropy_coef * agg(entropy) + kl_loss_coef * agg(kl(actor, reference))

Living in the core (not in a strategy) means ``hf``, ``deepspeed``, ``megatron`` and ``fsdp2`` all
optimise exactly the same thing; a strategy only supplies log-probs and the backward pass.
Tokens count where ``loss_mask`` is 1 (the response mask with masked samples removed).
"""

from __future__ import annotations

import torch

from roll_core.algorithms.losses import PolicyLossInput, aggregate, count_sequences, value_loss
from roll_core.data import Batch


def loss_mask_of(batch: Batch) -> torch.Tensor:
    """``loss_mask`` when the pipeline set one, else the response mask. ``[B, R]`` float."""
    return (batch["loss_mask"] if "loss_mask" in batch else batch["response_mask"]).float()


def loss_denominators(batch: Batch) -> tuple[float, float]:
    """``(tokens, sequences)`` that count in the loss of ``batch`` (a whole mini-batch).

    Strategies compute these once per mini-batch *before* splitting it into micro-batches (and, for
    data parallelism, sum them over ranks) so each micro-batch's loss is a share of the mini-batch
    loss and gradient accumulation does not change the result.
    """
    mask = loss_mask_of(batch)
    return float(mask.sum()), float(count_sequences(mask))


def kl_takes_distribution(name: str, plugins=None) -> bool:
    """Whether KL estimator ``name`` was registered with ``distribution=True`` (takes ``[B, R, V]``)."""
    from roll_core.plugins import get_plugins

    plugins = plugins or get_plugins()
    return bool(plugins.kl_estimators.entry(name).metadata.get("distribution"))


def needs_distribution(config, plugins=None) -> bool:
    """Whether the KL loss term needs full log-distributions ``[B, R, V]`` from the strategy."""
    return bool(config.kl_loss_coef) and kl_takes_distribution(config.kl_estimator, plugins)


def reuses_update_log_probs(config, batch_size: int, plugins=None) -> bool:
    """Whether the old log-probs can be the update's own (``algorithm.old_log_probs: auto``).

    With one epoch over one mini-batch the policy takes a single optimizer step per batch, so
    every micro-batch's forward pass runs on the weights the batch's old log-probs would be
    computed with: ``log pi_old = log pi.detach()`` exactly, and the trainer saves a forward pass
    over the whole batch (verl skips it the same way). Not when anything reads them before the
    update: the KL reward penalty, or an estimator registered with ``reads_old_log_probs=True``."""
    from roll_core.plugins import get_plugins

    if config.old_log_probs != "auto" or config.ppo_epochs != 1 or config.kl_penalty.coef > 0:
        return False
    if config.ppo_mini_batch_size is not None and config.ppo_mini_batch_size < batch_size:
        return False
    plugins = plugins or get_plugins()
    return not plugins.advantage_estimators.entry(config.advantage_estimator).metadata.get("reads_old_log_probs")


def actor_loss(
    log_prob: torch.Tensor,
    entropy: torch.Tensor | None,
    micro: Batch,
    config,
    *,
    global_tokens: float,
    global_seqs: float,
    max_response_length: int | None = None,
    log_dist: torch.Tensor | None = None,
    plugins=None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss of one micro-batch (scaled for accumulation over the mini-batch) and its metrics.

    Shapes: ``log_prob``, ``entropy`` ``[b, R]``; ``log_dist`` ``[b, R, V]`` only when the KL
    estimator is registered with ``distribution=True``.
    """
    from roll_core.plugins import get_plugins

    plugins = plugins or get_plugins()
    mask = loss_mask_of(micro).to(log_prob.dtype)
    horizon = max_response_length or mask.shape[-1]
    def agg(x):
        return aggregate(x, mask, config.loss_agg_mode, global_tokens=global_tokens,
                         global_seqs=global_seqs, max_response_length=horizon)
    policy_loss_fn = plugins.policy_losses.get(config.policy_loss)
    pg_mat, metrics = policy_loss_fn(
        PolicyLossInput(log_prob, micro["old_log_probs"] if "old_log_probs" in micro else log_prob.detach(),
                        micro["advantages"], mask,
                        micro["infer_log_probs"] if "infer_log_probs" in micro else None),
        config,
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
        if log_dist is not None and "ref_log_dist" in micro:
            kl_mat = kl_fn(log_dist, micro["ref_log_dist"])
        elif kl_takes_distribution(config.kl_estimator, plugins):
            kl_mat = None  # a distribution estimator without distributions: only reported when used
        else:
            kl_mat = kl_fn(log_prob, micro["ref_log_probs"])
        if kl_mat is not None:
            kl = agg(kl_mat)
            metrics["train/kl"] = kl.item()
            if config.kl_loss_coef:
                loss = loss + config.kl_loss_coef * kl
    return loss, metrics


def critic_loss(values: torch.Tensor, micro: Batch, config, *, global_tokens: float, global_seqs: float,
                max_response_length: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar value loss of one micro-batch (clipped, aggregated like the policy loss) and metrics.

    Reads ``values`` (the critic's values at rollout time) and ``returns`` (the estimator's targets).
    """
    mask = loss_mask_of(micro).to(values.dtype)
    mat = value_loss(values, micro["values"], micro["returns"], config.value_clip)
    loss = aggregate(mat, mask, config.loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
                     max_response_length=max_response_length or mask.shape[-1])
    err = ((values.detach() - micro["returns"]) * mask)
    return loss, {"critic/value_loss": loss.item(),
                  "critic/abs_error": float(err.abs().sum() / mask.sum().clamp(min=1))}
