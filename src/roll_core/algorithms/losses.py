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
    response_mask: torch.Tensor  # [B, R], 1 where the token counts in the loss
    infer_log_probs: torch.Tensor | None = None  # [B, R] reported by the inference engine (tis)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def count_sequences(mask: torch.Tensor) -> float:
    """Rows with at least one token in the loss (samples masked out entirely do not count)."""
    return float((mask.sum(-1) > 0).sum())


def _ratio(inputs: PolicyLossInput) -> tuple[torch.Tensor, torch.Tensor]:
    log_ratio = (inputs.log_prob - inputs.old_log_prob).clamp(-20.0, 20.0)
    return log_ratio.exp(), log_ratio


def _clipped_surrogate(ratio, log_ratio, inputs: PolicyLossInput, config):
    """``-min(ratio A, clip(ratio) A)`` and its metrics (shared by ``ppo_clip`` and ``gspo``)."""
    adv, mask = inputs.advantages, inputs.response_mask
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high) * adv
    return -torch.minimum(unclipped, clipped), {
        "clip_frac": _masked_mean((clipped < unclipped).float(), mask),
        "approx_kl": _masked_mean(-log_ratio.detach(), mask),
    }


def ppo_clip(inputs: PolicyLossInput, config) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), asymmetric clip range.

        ratio = exp(log_prob - old_log_prob)
        loss  = -min(ratio * A, clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high) * A)

    ``clip_ratio_high > clip_ratio_low`` is DAPO's clip-higher (arXiv:2503.14476).
    Shapes: all inputs ``[B, R]``; returns the loss ``[B, R]`` and scalar metrics.
    """
    ratio, log_ratio = _ratio(inputs)
    return _clipped_surrogate(ratio, log_ratio, inputs, config)


def dual_clip(inputs: PolicyLossInput, config) -> tuple[torch.Tensor, dict[str, float]]:
    """Dual-clip PPO (Ye et al. 2020, arXiv:1912.09729): also bound the loss of negative advantages.

        l = ppo_clip loss ;   for A < 0:  l = min(l, -dual_clip_c * A)      (dual_clip_c > 1, e.g. 3)

    When the ratio explodes on a negative-advantage token, the plain PPO loss grows without bound;
    the second clip caps it at ``c * |A|``. Shapes as :func:`ppo_clip`.
    """
    loss, metrics = ppo_clip(inputs, config)
    adv = inputs.advantages
    capped = torch.minimum(loss, -config.dual_clip_c * adv)
    out = torch.where(adv < 0, capped, loss)
    metrics["dual_clip_frac"] = _masked_mean(((adv < 0) & (capped < loss)).float(), inputs.response_mask)
    return out, metrics


def vanilla_pg(inputs: PolicyLossInput, config) -> tuple[torch.Tensor, dict[str, float]]:
    """Plain policy gradient (Williams 1992): ``loss = -A * log_prob``. Shapes as :func:`ppo_clip`."""
    return -inputs.advantages * inputs.log_prob, {}


def gspo(inputs: PolicyLossInput, config) -> tuple[torch.Tensor, dict[str, float]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071): sequence-level ratio.

        s_i     = exp( mean_t (log_prob_t - old_log_prob_t) )          geometric mean over the response
        s_{i,t} = sg(s_i) * pi(y_t) / sg(pi(y_t))                     same value, per-token gradient
        loss    = -min(s_{i,t} * A_i, clip(s_{i,t}, 1 - clip_ratio_low, 1 + clip_ratio_high) * A_i)

    Clip ranges are much smaller than PPO's (the paper uses 3e-4 / 4e-4). Use with
    ``loss_agg_mode: seq-mean-token-mean``. Shapes as :func:`ppo_clip`.
    """
    mask = inputs.response_mask
    log_ratio = (inputs.log_prob - inputs.old_log_prob).clamp(-20.0, 20.0) * mask
    seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)
    token_log_ratio = inputs.log_prob - inputs.log_prob.detach() + seq_log_ratio.detach()[:, None]
    ratio = token_log_ratio.clamp(max=20.0).exp()
    return _clipped_surrogate(ratio, log_ratio, inputs, config)


def tis(inputs: PolicyLossInput, config) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clip with truncated importance sampling against the inference engine (Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training"; Espeholt et al. 2018).

        w    = min(exp(old_log_prob - infer_log_prob), tis_cap)      detached
        loss = w * ppo_clip_loss

    The sampler (vLLM, SGLang, or an older policy in asynchronous training) and the trainer disagree
    slightly on probabilities; ``w`` corrects for it, truncated to bound the variance.
    Needs ``infer_log_probs`` (every roll scheduler records them). Shapes as :func:`ppo_clip`.
    """
    if inputs.infer_log_probs is None:
        raise ValueError("policy loss 'tis' needs the inference log-probs ('infer_log_probs' in the batch)")
    loss, metrics = ppo_clip(inputs, config)
    w = (inputs.old_log_prob - inputs.infer_log_probs).clamp(-20.0, 20.0).exp().clamp(max=config.tis_cap).detach()
    metrics["tis_weight_mean"] = _masked_mean(w, inputs.response_mask)
    return w * loss, metrics


def topr(inputs: PolicyLossInput, config) -> tuple[torch.Tensor, dict[str, float]]:
    """Tapered Off-Policy REINFORCE (Le Roux et al. 2025, arXiv:2503.14286).

        w_t  = topr_positive_weight                          if A_t >= 0   (SFT-like, no ratio)
             = topr_negative_weight * clip(ratio_t, 0, 1)    if A_t <  0   (tapered)
        loss = -sg(w_t) * A_t * log_prob_t

    Positive samples are pushed up at full strength whatever the ratio; negative ones only while
    the policy still puts at least the old probability on them, which keeps training stable far
    off-policy without a KL term. Shapes as :func:`ppo_clip`.
    """
    ratio, _ = _ratio(inputs)
    adv = inputs.advantages
    w = torch.where(adv >= 0, torch.full_like(ratio, config.topr_positive_weight),
                    config.topr_negative_weight * ratio.clamp(0.0, 1.0)).detach()
    return -w * adv * inputs.log_prob, {"negative_weight_mean": _masked_mean(w * (adv < 0), inputs.response_mask)}


def cispo(inputs: PolicyLossInput, config) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585).

        w    = sg(clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))
        loss = -w * A * log_prob

    Unlike PPO, clipping bounds the importance *weight* and never drops a token's gradient, so
    rare high-ratio "fork" tokens still learn. Shapes as :func:`ppo_clip`.
    """
    ratio, log_ratio = _ratio(inputs)
    w = ratio.clamp(1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high).detach()
    mask = inputs.response_mask
    return -w * inputs.advantages * inputs.log_prob, {
        "clip_frac": _masked_mean((w != ratio.detach()).float(), mask),
        "approx_kl": _masked_mean(-log_ratio.detach(), mask),
    }


def kimi(inputs: PolicyLossInput, config) -> tuple[torch.Tensor, dict[str, float]]:
    """Kimi k1.5 style policy mirror descent (Kimi Team 2025, arXiv:2501.12599), per token:

        loss = -A * log_prob + (kimi_tau / 2) * (log_prob - old_log_prob)^2

    The squared log-ratio keeps the update close to the sampling policy (a relative-entropy
    regulariser) in place of clipping. Shapes as :func:`ppo_clip`.
    """
    log_ratio = inputs.log_prob - inputs.old_log_prob
    loss = -inputs.advantages * inputs.log_prob + 0.5 * config.kimi_tau * log_ratio**2
    return loss, {"approx_kl": _masked_mean(-log_ratio.detach(), inputs.response_mask)}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None):
    """Clipped value loss of PPO's critic (Schulman et al. 2017; as in OpenAI baselines' ppo2).

        V_clip = V_old + clip(V - V_old, -clip, clip)
        loss   = 0.5 * max((V - G)^2, (V_clip - G)^2)          (no clipping when ``clip`` is None)

    Shapes: all ``[B, R]``; returns the per-token loss ``[B, R]`` (aggregate it like the policy loss).
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped)


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
    seqs = global_seqs if global_seqs is not None else count_sequences(mask)
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
