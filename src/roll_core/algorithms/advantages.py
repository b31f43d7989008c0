"""Advantage estimators: ``fn(batch: AdvantageInput, config: AlgorithmConfig) -> (advantages, returns)``.

Both outputs are ``[B, R]`` and zero where ``response_mask`` is 0. Outcome-reward estimators read
the sequence score as the sum of ``token_level_rewards`` over the response (the scheduler puts the
score on the last valid token; a token-level KL penalty adds to every token).

Multi-turn estimators (``step_reinforce``, ``agentic_reinforce``, ``gigpo``) read ``turn_index``:
which turn each response token belongs to (``-1`` for tokens the policy did not produce, such as
environment observations). When it is absent the whole response is one turn, so every estimator
also runs on single-turn RLVR batches.
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
    values: torch.Tensor | None = None  # [B, R] critic values V(s_t) (gae)
    old_log_probs: torch.Tensor | None = None  # [B, R] behaviour policy (opd)
    teacher_log_probs: torch.Tensor | None = None  # [B, R] teacher / reference policy (opd)
    turn_index: torch.Tensor | None = None  # [B, R] long, turn of each token, -1 = not a policy token
    state_hash: torch.Tensor | None = None  # [B, T] long, hash of the state each turn acted in (gigpo)


# ------------------------------------------------------------------------------------------------
# shared helpers
# ------------------------------------------------------------------------------------------------
def group_stats(scores: torch.Tensor, group_index: torch.Tensor):
    """Per-row mean, unbiased std and size of the row's group. Shapes ``[B]`` in, ``[B]`` out."""
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    n = counts[inverse].to(scores.dtype)
    sums = torch.zeros(len(counts), dtype=scores.dtype).index_add_(0, inverse, scores)
    mean = (sums / counts.to(scores.dtype))[inverse]
    sq = torch.zeros(len(counts), dtype=scores.dtype).index_add_(0, inverse, (scores - mean) ** 2)
    var = sq[inverse] / (n - 1).clamp(min=1)
    return mean, var.sqrt(), n


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True) -> torch.Tensor:
    """Whitening over the entries where ``mask`` is 1; 0 elsewhere. Shapes ``[B, R]`` in and out.

        shift_mean=True:   (x - mean) / sqrt(var + eps)
        shift_mean=False:  (x - mean) / sqrt(var + eps) + mean     (rewards: rescale the spread, keep the mean)

    ``var`` is the unbiased (Bessel-corrected) variance, as in :func:`group_stats` and as verl and
    OpenRLHF compute it. Only the centred part is divided, so all-equal values come back unchanged
    (not divided by ``eps``) and near-equal ones stay within ``|x - mean| / sqrt(eps)`` of the mean.
    With fewer than two valid entries there is no spread to measure and ``x`` is returned as it is.
    """
    count = mask.sum()
    if count < 2:
        return x * mask
    mean = (x * mask).sum() / count
    var = (((x - mean) * mask) ** 2).sum() / (count - 1)
    whitened = (x - mean) * torch.rsqrt(var + EPS)
    return (whitened if shift_mean else whitened + mean) * mask


def discounted_returns(token_level_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_next(t)`` over the valid tokens of each row, 0 on masked ones.

    ``next(t)`` is the next token where ``mask`` is 1: masked tokens in the middle of a response
    (environment observations between turns) are skipped, not taken as the end of the episode, so
    early turns still get credit for a reward at the end; this is how :func:`gae` treats them too.
    Rewards on masked tokens are ignored. Shapes: ``[B, R]`` in and out.
    """
    valid = mask > 0
    rewards = token_level_rewards * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        current = rewards[:, t] + gamma * running
        returns[:, t] = torch.where(valid[:, t], current, torch.zeros_like(current))
        running = torch.where(valid[:, t], current, running)
    return returns


def _outcome(batch: AdvantageInput) -> torch.Tensor:
    return (batch.token_level_rewards * batch.response_mask).sum(-1)


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_seq[:, None] * mask


def turn_layout(batch: AdvantageInput) -> tuple[torch.Tensor, int]:
    """``turn_index`` ``[B, R]`` (single turn 0 when absent, -1 on padding) and the number of turns T."""
    if batch.turn_index is None:
        turns = torch.where(batch.response_mask > 0, 0, -1).long()
    else:
        turns = torch.where(batch.response_mask > 0, batch.turn_index.long(), -1)
    return turns, int(turns.max().item()) + 1 if turns.numel() and turns.max() >= 0 else 0


def turn_rewards(batch: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-turn reward ``[B, T]`` (sum of the turn's token rewards), turn validity ``[B, T]`` and
    the token-to-turn map ``[B, R]``."""
    turns, n_turns = turn_layout(batch)
    rows = batch.token_level_rewards.shape[0]
    onehot = torch.zeros(rows, batch.token_level_rewards.shape[1], max(n_turns, 1))
    valid_tok = turns >= 0
    onehot[valid_tok.nonzero(as_tuple=True) + (turns[valid_tok],)] = 1.0
    rewards = torch.einsum("br,brt->bt", batch.token_level_rewards * batch.response_mask, onehot)
    valid = onehot.sum(1) > 0
    return rewards, valid, turns


def turn_returns(rewards: torch.Tensor, valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_k = r_k + gamma * G_{k+1}`` over the valid turns of each row. ``[B, T]``."""
    return discounted_returns(rewards, valid.to(rewards.dtype), gamma)


def turns_to_tokens(per_turn: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """Give every token the value of its turn. ``[B, T]`` and ``[B, R]`` -> ``[B, R]`` (0 where -1)."""
    gathered = per_turn.gather(1, turns.clamp(min=0))
    return torch.where(turns >= 0, gathered, torch.zeros_like(gathered))


# ------------------------------------------------------------------------------------------------
# critic-based
# ------------------------------------------------------------------------------------------------
def gae(batch: AdvantageInput, config) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438) for PPO with a critic.

        delta_t = r_t + gamma * V_{t+1} - V_t          (V after the last valid token is 0)
        A_t     = delta_t + gamma * lam * A_{t+1}
        returns = A + V                                (the critic's regression target)

    Needs ``values`` from the critic role. Advantages are returned un-whitened; PPO recipes set
    ``algorithm.whiten_advantages``.
    Shapes: token_level_rewards, values, response_mask ``[B, R]``; returns ``[B, R]`` twice.
    """
    if batch.values is None:
        raise ValueError("advantage estimator 'gae' needs critic values (configure roles.critic)")
    mask = batch.response_mask
    values = batch.values * mask
    rewards = batch.token_level_rewards * mask
    adv = torch.zeros_like(rewards)
    last = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    next_value = torch.zeros_like(last)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t] > 0
        delta = rewards[:, t] + config.gamma * next_value - values[:, t]
        current = delta + config.gamma * config.lam * last
        adv[:, t] = torch.where(m, current, torch.zeros_like(current))
        # Masked tokens (padding, environment observations) are skipped, not treated as terminal:
        # a token's successor is the next *valid* token.
        last = torch.where(m, current, last)
        next_value = torch.where(m, values[:, t], next_value)
    return adv * mask, (adv + values) * mask


# ------------------------------------------------------------------------------------------------
# critic-free, outcome rewards
# ------------------------------------------------------------------------------------------------
def grpo(batch: AdvantageInput, config) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage (GRPO; Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)     (std = unbiased sample std)

    With ``config.norm_adv_by_std = False`` the division is skipped (Dr. GRPO, Liu et al. 2025,
    arXiv:2503.20783). A group of one has no baseline: its advantage is 0.
    The sequence advantage is broadcast to every response token.

    Shapes: token_level_rewards, response_mask ``[B, R]``; group_index ``[B]``; returns ``[B, R]`` twice.
    """
    scores = _outcome(batch)
    mean, std, n = group_stats(scores, batch.group_index)
    adv = scores - mean
    if config.norm_adv_by_std:
        adv = adv / (std + EPS)
    adv = _broadcast(torch.where(n > 1, adv, torch.zeros_like(adv)), batch.response_mask)
    return adv, adv


def rloo(batch: AdvantageInput, config) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740; Kool et al. 2019).

        A_i = r_i - (sum_{j in group, j != i} r_j) / (n - 1)  =  n / (n - 1) * (r_i - mean(r_group))

    A group of one has no other sample to form a baseline: its advantage is 0.
    Shapes as :func:`grpo`.
    """
    scores = _outcome(batch)
    mean, _, n = group_stats(scores, batch.group_index)
    adv = torch.where(n > 1, n / (n - 1).clamp(min=1) * (scores - mean), torch.zeros_like(scores))
    adv = _broadcast(adv, batch.response_mask)
    return adv, adv


def reinforce(batch: AdvantageInput, config) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE (Williams 1992) without a baseline: the advantage is the discounted return.

        A_t = G_t = sum_{k >= t} gamma^(k - t) r_k

    Pair it with ``algorithm.reward_norm`` for a baseline (LitePPO: group mean, batch std).
    Shapes: ``[B, R]`` in and out.
    """
    returns = discounted_returns(batch.token_level_rewards, batch.response_mask, config.gamma)
    return returns, returns


def reinforce_plus_plus(batch: AdvantageInput, config) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted returns whitened over the whole batch.

        G_t = sum_{k >= t} gamma^(k - t) r_k ;   A_t = (G_t - mean_batch(G)) / sqrt(var_batch(G) + eps)

    (``var`` unbiased, over valid tokens; see :func:`masked_whiten`.)

    Shapes: ``[B, R]`` in and out; the returns are the un-whitened ``G``.
    """
    returns = discounted_returns(batch.token_level_rewards, batch.response_mask, config.gamma)
    return masked_whiten(returns, batch.response_mask), returns


def reinforce_plus_plus_baseline(batch: AdvantageInput, config) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262 v3): group-mean baseline, then batch whitening.

        A_i = (r_i - mean(r_group)) ;   A <- (A - mean_batch(A)) / std_batch(A)

    The group mean removes prompt difficulty; the batch std (not the group std, as in GRPO) keeps
    groups with small reward spread from being blown up. Shapes as :func:`grpo`.
    """
    scores = _outcome(batch)
    mean, _, _ = group_stats(scores, batch.group_index)
    centred = _broadcast(scores - mean, batch.response_mask)
    return masked_whiten(centred, batch.response_mask), centred


def raft(batch: AdvantageInput, config) -> tuple[torch.Tensor, torch.Tensor]:
    """RAFT / rejection sampling (Dong et al. 2023, arXiv:2304.06767; RAFT++: Xiong et al. 2025,
    arXiv:2504.11343): learn only from accepted samples.

        A_i = 1 if r_i > raft_threshold else 0

    With the ``ppo_clip`` loss this is RAFT++ (importance sampling and clipping on accepted
    samples). Shapes as :func:`grpo`.
    """
    scores = _outcome(batch)
    adv = _broadcast((scores > config.raft_threshold).to(scores.dtype), batch.response_mask)
    return adv, adv


# ------------------------------------------------------------------------------------------------
# multi-turn (agentic)
# ------------------------------------------------------------------------------------------------
def step_reinforce(batch: AdvantageInput, config) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-level REINFORCE for multi-turn trajectories: per-turn discounted returns, batch-whitened.

        r_k = sum of the token rewards of turn k ;  G_k = r_k + gamma * G_{k+1}
        A_k = (G_k - mean(G)) / std(G)    (mean/std over every valid turn in the batch)

    Each token of turn k gets ``A_k``. Credit is assigned per turn (an action of the agent), not
    per token. Shapes: ``[B, R]`` in and out (``turn_index`` ``[B, R]``).
    """
    rewards, valid, turns = turn_rewards(batch)
    returns = turn_returns(rewards, valid, config.gamma)
    adv = masked_whiten(returns, valid.to(returns.dtype))
    return turns_to_tokens(adv, turns), turns_to_tokens(returns, turns)


def agentic_reinforce(batch: AdvantageInput, config) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-turn REINFORCE with a group baseline (trajectory-wise training as in StarPO / RAGEN,
    Wang et al. 2025, arXiv:2504.20073):

        A_{i,k} = G_{i,k} - mean_{j in group(i)} G_{j,0}

    where ``G_{i,k}`` is the discounted return of trajectory i from turn k and ``G_{j,0}`` the full
    return of each trajectory of the same group. With one turn it is ``r_i - mean(r_group)``.
    Shapes: ``[B, R]`` in and out.
    """
    rewards, valid, turns = turn_rewards(batch)
    returns = turn_returns(rewards, valid, config.gamma)
    episode = returns[:, 0] if returns.shape[1] else torch.zeros(returns.shape[0])
    mean, _, n = group_stats(episode, batch.group_index)
    adv = torch.where((n > 1)[:, None], returns - mean[:, None], torch.zeros_like(returns)) * valid
    return turns_to_tokens(adv, turns), turns_to_tokens(returns, turns)


def gigpo(batch: AdvantageInput, config) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-in-Group Policy Optimization (Feng et al. 2025, arXiv:2505.10978).

        A_E(i)   = (R_i - mean_{group} R) / std_{group} R            episode level, R_i = sum_k r_{i,k}
        A_S(i,k) = (G_{i,k} - mean_{S} G) / std_{S} G                 step level
        A(i,k)   = A_E(i) + gigpo_step_weight * A_S(i,k)

    The step group ``S`` of turn (i, k) holds every turn of the same episode group that acted in the
    same environment state (equal ``state_hash``): anchor states shared across trajectories give a
    per-step baseline without a critic. Step groups of one contribute 0. Without ``state_hash``
    each turn index is its own state (``k``). ``norm_adv_by_std=False`` skips both divisions.
    Shapes: ``[B, R]`` in and out; ``state_hash`` ``[B, T]``.
    """
    rewards, valid, turns = turn_rewards(batch)
    n_turns = rewards.shape[1]
    returns = turn_returns(rewards, valid, config.gamma)
    episode = rewards.sum(1)
    mean, std, n = group_stats(episode, batch.group_index)
    a_episode = episode - mean
    if config.norm_adv_by_std:
        a_episode = a_episode / (std + EPS)
    a_episode = torch.where(n > 1, a_episode, torch.zeros_like(a_episode))

    states = batch.state_hash if batch.state_hash is not None else torch.arange(n_turns).expand_as(rewards)
    states = states[:, :n_turns].long()
    flat_valid = valid.flatten()
    a_step = torch.zeros(valid.numel(), dtype=returns.dtype)
    if flat_valid.any():
        # One step group per (episode group, state): pack both into a single key.
        groups = batch.group_index[:, None].expand_as(states).flatten()[flat_valid]
        _, group_ids = torch.unique(groups, return_inverse=True)
        _, state_ids = torch.unique(states.flatten()[flat_valid], return_inverse=True)
        key = group_ids * (int(state_ids.max()) + 1) + state_ids
        g = returns.flatten()[flat_valid]
        s_mean, s_std, s_n = group_stats(g, key)
        step = g - s_mean
        if config.norm_adv_by_std:
            step = step / (s_std + EPS)
        a_step[flat_valid] = torch.where(s_n > 1, step, torch.zeros_like(step))
    adv = (a_episode[:, None] + config.gigpo_step_weight * a_step.view_as(returns)) * valid
    return turns_to_tokens(adv, turns), turns_to_tokens(returns, turns)


# ------------------------------------------------------------------------------------------------
# distillation
# ------------------------------------------------------------------------------------------------
def opd(batch: AdvantageInput, config) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation (Agarwal et al. 2024, GKD, arXiv:2306.13649; Lu & Thinking Machines 2025).

        A_t = log pi_teacher(y_t | y_<t) - log pi_old(y_t | y_<t)

    the negative per-token reverse KL on the student's own samples: maximising it pulls the student
    toward the teacher where the student actually goes. The teacher is the ``reference`` role
    (``roles.reference.model_path``). Shapes: log-probs and mask ``[B, R]``; returns ``[B, R]`` twice.
    """
    if batch.teacher_log_probs is None or batch.old_log_probs is None:
        raise ValueError("advantage estimator 'opd' needs teacher log-probs (configure roles.reference)")
    adv = (batch.teacher_log_probs - batch.old_log_probs) * batch.response_mask
    return adv, adv
