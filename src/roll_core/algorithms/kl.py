"""KL estimators between the actor and the reference policy, per token.

``fn(log_prob [B, R], ref_log_prob [B, R]) -> kl [B, R]``, estimated from samples drawn from the actor;
estimators registered with ``distribution=True`` (``full``) take ``[B, R, V]`` log-distributions.
See Schulman, "Approximating KL Divergence" (2020), for k1/k2/k3.
"""

from __future__ import annotations

import torch

K3_BOUND = 10.0  # |k3| per token, as ROLL and verl bound low_var_kl


def k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``k1 = log p - log q``: unbiased for KL(p || q), high variance, can be negative."""
    return log_prob - ref_log_prob


def k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``k2 = 0.5 (log p - log q)^2`` ("mse"): biased, low variance, always >= 0."""
    return 0.5 * (log_prob - ref_log_prob) ** 2


def k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(log q - log p) - (log q - log p) - 1`` ("low_var_kl"): unbiased and >= 0.

    Bounded, because it is unbounded in the log-ratio (a log-ratio of 20 gives about 4.85e8, with a
    gradient as large): the log-ratio is clamped to [-20, 20] so the exponential stays finite, and
    the estimate to [-K3_BOUND, K3_BOUND] = [-10, 10], in the KL loss term and in the reward
    penalty alike (both call this function). A token beyond the bound gets no gradient from it.
    """
    delta = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
    return (delta.exp() - delta - 1.0).clamp(-K3_BOUND, K3_BOUND)


def abs_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``|log p - log q|``: the magnitude of k1, biased but never negative (registered as ``abs``)."""
    return (log_prob - ref_log_prob).abs()


def full(log_dist: torch.Tensor, ref_log_dist: torch.Tensor) -> torch.Tensor:
    """Exact per-position ``KL(p || q) = sum_v p(v) (log p(v) - log q(v))`` over the vocabulary.

    Takes full log-distributions ``[B, R, V]`` (registered with ``distribution=True``, so strategies
    and the pipeline pass log-softmax over the vocabulary instead of the sampled token's log-prob)
    and returns ``[B, R]``. No sampling noise, at ``V`` times the memory: for small vocabularies or
    short responses.
    """
    if log_dist.dim() != 3 or ref_log_dist.dim() != 3:
        raise ValueError("kl estimator 'full' needs [B, R, V] log-distributions, got "
                         f"{tuple(log_dist.shape)} and {tuple(ref_log_dist.shape)}")
    # Positions where both are all-zero (padding) give 0.
    return (log_dist.exp() * (log_dist - ref_log_dist)).sum(-1)
