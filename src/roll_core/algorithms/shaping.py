"""Reward shaping, sample masks and dynamic sampling, applied in one fixed, documented order.

Every option lives under ``algorithm`` in the config and is off by default. For one RL step the
pipeline calls :meth:`RewardShaper.shape`, which does, in this order:

  1. sample masks          ``max_length_mask``: drop responses cut off at ``max_new_tokens``;
                           ``difficulty_mask``: keep a group only if its mean score is in (low, high)
  2. reward normalisation  ``reward_norm``: ``(s - mean) / std`` with the mean and the std each
                           taken over the ``batch``, the prompt's ``group``, a ``running`` estimate
                           across steps, or ``none`` (LitePPO: mean over group, std over batch)
  3. reward clip           ``reward_clip``: scores clamped to ``[-c, c]``
  4. token placement       each score on its response's last valid token; multi-turn rows
                           (``turn_rewards``, :mod:`roll_core.agentic.samples`) put each turn's
                           reward on its action's last token instead, skipping steps 2-3, and
                           train their ``action_mask`` only
  5. KL penalty            ``kl_penalty``: ``r_t -= beta * kl_t(actor_old || reference)``, fixed beta or
                           the adaptive controller of Ziegler et al. 2019 (arXiv:1909.08593)
  6. reward whitening      ``whiten_rewards``: ``(r - mean) / sqrt(var + eps) + mean`` (spread rescaled, mean kept)
  7. advantage estimator   the registered ``advantage_estimator``, plus ``opd_coef`` times the
                           ``opd`` advantage ``log pi_teacher - log pi_old`` per token (on-policy
                           distillation beside a reward; the teacher is ``roles.reference``)
  8. advantage whitening   ``whiten_advantages``: over the valid tokens of unmasked samples
  9. advantage clip        ``advantage_clip``: advantages clamped to ``[-c, c]``

Dynamic sampling (``dynamic_sampling``, DAPO arXiv:2503.14476) happens earlier, at collection:
groups failing the mean or std filter are dropped and more prompts are drawn (:func:`keep_groups`).
Sample masks zero a sample's ``loss_mask``: it still counts for normalisation statistics of the
batch but contributes neither to the loss nor to the loss denominators.
"""

from __future__ import annotations

import math

import torch

from roll_core.agentic.samples import turn_token_rewards
from roll_core.algorithms.advantages import AdvantageInput, group_stats, masked_whiten, opd

EPS = 1e-6


def outcome_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score on its last valid response token. ``[B]`` -> ``[B, R]``."""
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = (response_mask.sum(-1) - 1).clamp(min=0).long()
    rewards[torch.arange(len(scores)), last] = scores.float()
    return rewards * (response_mask.sum(-1, keepdim=True) > 0)


# ------------------------------------------------------------------------------------------------
# group filters (dynamic sampling and difficulty mask share them)
# ------------------------------------------------------------------------------------------------
def group_mean_inside(scores: torch.Tensor, group_index: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Rows whose group's mean score lies strictly inside ``(low, high)``. ``[B]`` bool."""
    mean, _, _ = group_stats(scores.double(), group_index)
    return (mean > low) & (mean < high)


def keep_groups(scores: torch.Tensor, group_index: torch.Tensor, cfg) -> torch.Tensor:
    """Dynamic-sampling filter (``cfg`` is ``algorithm.dynamic_sampling``). ``[B]`` bool, whole groups.

    * ``mean``: keep groups whose mean score is in ``(mean_low, mean_high)``; with 0/1 rewards and
      the defaults (0, 1) this drops all-wrong and all-right groups, which carry no GRPO signal.
    * ``std``: keep groups whose (unbiased) score std exceeds ``std_min``.
    * ``none``: keep everything.
    """
    if cfg.filter == "none":
        return torch.ones(len(scores), dtype=torch.bool)
    if cfg.filter == "mean":
        return group_mean_inside(scores, group_index, cfg.mean_low, cfg.mean_high)
    _, std, n = group_stats(scores.double(), group_index)
    return (std > cfg.std_min) & (n > 1)


# ------------------------------------------------------------------------------------------------
# running statistics and the adaptive KL controller (checkpointed state)
# ------------------------------------------------------------------------------------------------
class RunningMoments:
    """Mean and variance of every score seen so far (Chan et al. parallel update of Welford's)."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, x: torch.Tensor) -> None:
        n = x.numel()
        if n == 0:
            return
        mean, m2 = float(x.double().mean()), float(((x.double() - x.double().mean()) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 1.0


class AdaptiveKLController:
    """Ziegler et al. 2019 (arXiv:1909.08593), proportional control of the KL penalty ``beta``:

        e     = clip(kl / target_kl - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n / horizon)          n = samples in the step
    """

    def __init__(self, init: float, target: float, horizon: int):
        self.value, self.target, self.horizon = init, target, horizon

    def update(self, kl: float, n: int) -> None:
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n / self.horizon


# ------------------------------------------------------------------------------------------------
# the shaper
# ------------------------------------------------------------------------------------------------
class RewardShaper:
    """Turns a scored batch into ``token_level_rewards``, ``advantages``, ``returns`` and ``loss_mask``.

    ``config`` is the run's ``algorithm`` section; ``plugins`` resolves the estimator and the KL
    estimator by name. State (running moments, adaptive beta) is saved with every checkpoint.
    """

    def __init__(self, config, plugins):
        from roll_core.algorithms.objective import bind_options, kl_takes_distribution

        self.config = config
        # resolved once: no registry lookups per step
        self.estimator = bind_options(plugins.advantage_estimators, config.advantage_estimator,
                                      config.advantage_estimator_options)
        self.kl_estimator = plugins.kl_estimators.get(config.kl_penalty.estimator)
        self.kl_distribution = kl_takes_distribution(config.kl_penalty.estimator, plugins)
        self.running = RunningMoments()
        kl = config.kl_penalty
        self.kl_coef = AdaptiveKLController(kl.coef, kl.target_kl, kl.horizon) if kl.adaptive else None

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"running": [self.running.count, self.running.mean, self.running.m2],
                "kl_coef": self.kl_coef.value if self.kl_coef else None}

    def load_state_dict(self, state: dict) -> None:
        self.running.count, self.running.mean, self.running.m2 = state["running"]
        if self.kl_coef is not None and state.get("kl_coef") is not None:
            self.kl_coef.value = state["kl_coef"]

    @property
    def beta(self) -> float:
        return self.kl_coef.value if self.kl_coef else self.config.kl_penalty.coef

    # -- the steps ------------------------------------------------------------------------------
    def sample_mask(self, batch) -> torch.Tensor:
        """Step 1. ``[B]`` float, 1 = the sample trains."""
        cfg = self.config
        keep = torch.ones(len(batch), dtype=torch.bool)
        if cfg.max_length_mask and "truncated" in batch:
            keep &= ~batch["truncated"].bool()
        if cfg.difficulty_mask is not None:
            dm = cfg.difficulty_mask
            keep &= group_mean_inside(batch["scores"], batch["group_index"], dm.low, dm.high)
        return keep.float()

    def normalize(self, scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
        """Step 2. ``[B]`` -> ``[B]``."""
        norm = self.config.reward_norm
        scores = scores.double()
        if "running" in (norm.mean, norm.std):
            self.running.update(scores)
        g_mean, g_std, _ = group_stats(scores, group_index)
        b_std = scores.std() if len(scores) > 1 else torch.tensor(1.0, dtype=scores.dtype)
        means = {"none": 0.0, "batch": scores.mean(), "group": g_mean, "running": self.running.mean}
        stds = {"none": None, "batch": b_std, "group": g_std, "running": self.running.std}
        out = scores - means[norm.mean]
        std = stds[norm.std]
        if std is not None:
            out = out / (torch.as_tensor(std, dtype=scores.dtype) + EPS)
        return out.float()

    def kl_penalty(self, token_rewards: torch.Tensor, batch, mask: torch.Tensor):
        """Step 5. Returns the penalised rewards and the mean per-sequence KL."""
        if self.kl_distribution:
            kl = self.kl_estimator(batch["old_log_dist"], batch["ref_log_dist"])
        else:
            kl = self.kl_estimator(batch["old_log_probs"], batch["ref_log_probs"])
        kl = kl * mask
        seq_kl = float(kl.sum(-1).mean())
        beta = self.beta
        if self.kl_coef is not None:
            self.kl_coef.update(seq_kl, len(batch))
        return token_rewards - beta * kl, seq_kl, beta

    def shape(self, batch) -> dict[str, float]:
        """Run steps 1-9 on ``batch`` (in place) and return metrics."""
        cfg = self.config
        # multi-turn rows (roll_core.agentic.samples): the loss covers the actions, not the replies
        mask = (batch["action_mask"] if "action_mask" in batch else batch["response_mask"]).float()
        sample_mask = self.sample_mask(batch)
        loss_mask = mask * sample_mask[:, None]
        metrics = {"shaping/masked_samples": float(len(batch) - sample_mask.sum())}

        if "turn_rewards" in batch:  # each turn's reward, as the environment gave it, on its action's last token
            rewards = turn_token_rewards(batch["turn_rewards"].float(), batch["turn_index"])
        else:
            scores = self.normalize(batch["scores"].float(), batch["group_index"])
            if cfg.reward_clip is not None:
                scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
            rewards = outcome_token_rewards(scores, batch["response_mask"])
        if cfg.kl_penalty.coef > 0:
            rewards, seq_kl, beta = self.kl_penalty(rewards, batch, mask)
            metrics.update({"shaping/kl_penalty_kl": seq_kl, "shaping/kl_coef": beta})
        if cfg.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False)

        inputs = AdvantageInput(
            token_level_rewards=rewards,
            response_mask=mask,
            group_index=batch["group_index"],
            values=batch["values"] if "values" in batch else None,
            old_log_probs=batch["old_log_probs"] if "old_log_probs" in batch else None,
            teacher_log_probs=batch["ref_log_probs"] if "ref_log_probs" in batch else None,
            turn_index=batch["turn_index"] if "turn_index" in batch else None,
            state_hash=batch["state_hash"] if "state_hash" in batch else None,
        )
        adv, returns = self.estimator(inputs, cfg)
        if cfg.opd_coef > 0:
            distill, _ = opd(inputs, cfg)
            adv = adv + cfg.opd_coef * distill
            metrics["advantage/opd_abs_mean"] = float(distill.abs().sum() / mask.sum().clamp(min=1))
        if cfg.whiten_advantages:
            adv = masked_whiten(adv, loss_mask)
        if cfg.advantage_clip is not None:
            adv = adv.clamp(-cfg.advantage_clip, cfg.advantage_clip)
        adv = adv * loss_mask
        batch.update(token_level_rewards=rewards, advantages=adv, returns=returns, loss_mask=loss_mask)
        metrics["advantage/abs_mean"] = float(adv.abs().sum() / loss_mask.sum().clamp(min=1))
        return metrics
