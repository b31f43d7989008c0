"""Advantage estimators: ``fn(batch: AdvantageInput, config: AlgorithmConfig) -> (advantages, returns)``.

Both outputs are ``[B, R]`` and zero where ``response_mask`` is 0. Outcome-reward estimators read
the sequence score as the sum of ``token_level_rewards`` over the response.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EPS = 1e-6


@dataclass
class AdvantageInput:
    token_level_rewards: torch.Tensor  # [B, R], outcome reward usually on the last valid token
    response_mask: torch.Tensor  # [B, R], 1 for generated tokens
    group_index: torch.Tensor  # [B] long, rows with the same value answer the same prompt
    values: torch.Tensor | None = None  # [B, R] critic values (GAE)


def _group_stats(scores: torch.Tensor, group_index: torch.Tensor):
    """Per-row mean, unbiased std and size of the row's group. Shapes ``[B]``."""
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    n = counts[inverse].to(scores.dtype)
    sums = torch.zeros(len(counts), dtype=scores.dtype).index_add_(0, inverse, scores)
    mean = (sums / counts.to(scores.dtype))[inverse]
    sq = torch.zeros(len(counts), dtype=scores.dtype).index_add_(0, inverse, (scores - mean) ** 2)
    var = sq[inverse] / (n - 1).clamp(min=1)
    return mean, var.sqrt(), n


def grpo(batch: AdvantageInput, config) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage (GRPO; Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)     (std = unbiased sample std)

    With ``config.norm_adv_by_std = False`` the division is skipped (Dr. GRPO, Liu et al. 2025,
    arXiv:2503.20783). A group of one has no baseline: its advantage is 0.
    The sequence advantage is broadcast to every response token.

    Shapes: token_level_rewards, response_mask ``[B, R]``; group_index ``[B]``; returns ``[B, R]`` twice.
    """
    scores = batch.token_level_rewards.sum(-1)
    mean, std, n = _group_stats(scores, batch.group_index)
    adv = scores - mean
    if config.norm_adv_by_std:
        adv = adv / (std + EPS)
    adv = torch.where(n > 1, adv, torch.zeros_like(adv))
    adv = adv[:, None] * batch.response_mask
    return adv, adv


def rloo(batch: AdvantageInput, config) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740; Kool et al. 2019).

        A_i = r_i - (sum_{j in group, j != i} r_j) / (n - 1)  =  n / (n - 1) * (r_i - mean(r_group))

    A group of one has no other sample to form a baseline: its advantage is 0.
    Shapes as :func:`grpo`.
    """
    scores = batch.token_level_rewards.sum(-1)
    mean, _, n = _group_stats(scores, batch.group_index)
    adv = torch.where(n > 1, n / (n - 1).clamp(min=1) * (scores - mean), torch.zeros_like(scores))
    adv = adv[:, None] * batch.response_mask
    return adv, adv


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the entries where ``mask`` is 1 (biased std), 0 elsewhere."""
    count = mask.sum().clamp(min=1)
    mean = (x * mask).sum() / count
    var = (((x - mean) * mask) ** 2).sum() / count
    return (x - mean) / (var.sqrt() + EPS) * mask


def discounted_returns(token_level_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` within the response (reset at padding). Shape ``[B, R]``."""
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros(token_level_rewards.shape[0], dtype=token_level_rewards.dtype)
    for t in reversed(range(token_level_rewards.shape[1])):
        running = token_level_rewards[:, t] + gamma * running * mask[:, t]
        returns[:, t] = running
    return returns * mask


def reinforce_plus_plus(batch: AdvantageInput, config) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted returns whitened over the whole batch.

        G_t = sum_{k >= t} gamma^(k - t) r_k ;   A_t = (G_t - mean_batch(G)) / std_batch(G)

    Shapes: ``[B, R]`` in and out; the returns are the un-whitened ``G``.
    """
    returns = discounted_returns(batch.token_level_rewards, batch.response_mask, config.gamma)
    return masked_whiten(returns, batch.response_mask), returns
