"""Train/inference mismatch: how far the training engine's log-probs of the inference engine's
samples are from the inference engine's own log-probs of them.

Importance ratios, clipping and KL terms all assume the two engines compute the same distribution
for the same weights. When they do not (bf16 in one and fp32 in the other, different attention
kernels, weights that never reached the engine, a tokenizer or chat template that differs, a
sampling setting the log-probs ignore) training quietly optimises the wrong thing. So:

* at step 0, before any update, when both roles hold the same weights, ``rlvr`` samples
  ``PROMPTS`` held-out prompts with the run's sampling settings, scores the samples with
  actor_train and logs the mean absolute gap per sampled token as ``train/infer_log_prob_gap``
  (the inference workers' sampling RNG is put back afterwards, so the run draws what it would
  have drawn without the check);
* every RL step logs the same metric from the first mini-batch of its update
  (:mod:`roll_core.algorithms.objective`); under asynchronous generation it includes the policy's
  drift since the samples were drawn;
* ``trainer.max_initial_mismatch`` stops a run whose step-0 gap exceeds it, before any training.

``hf`` against ``hf`` or ``vllm`` in fp32 measures about 1e-6 per token.
"""

from __future__ import annotations

import torch

from roll_core.data import Batch
from roll_core.errors import RollError

PROMPTS = 32  # held-out prompts sampled by the step-0 check


class MismatchError(RollError):
    """The engines disagree at step 0 by more than ``trainer.max_initial_mismatch``."""


def log_prob_gap(train_log_probs: torch.Tensor, infer_log_probs: torch.Tensor, mask: torch.Tensor) -> float:
    """``sum(|train - infer| * mask) / sum(mask)``: mean absolute per-token gap, all ``[B, R]``."""
    mask = mask.float()
    return float(((train_log_probs - infer_log_probs).abs() * mask).sum() / mask.sum().clamp(min=1))


def initial_mismatch(executor, infer, actor, prompts: Batch, rollout, use=lambda *roles: None) -> float:
    """Sample ``prompts`` on ``infer`` (``rollout``'s settings), score the samples on ``actor`` and
    return :func:`log_prob_gap`; the inference workers' RNG states are restored afterwards.
    ``use(role)`` makes a role resident first (colocated roles time-share their devices)."""
    from roll_core.pipelines.runtime import log_probs

    use(infer.role)
    states = executor.get(infer.call("rng_state"))
    try:
        samples = Batch.concat(executor.get(infer.per_replica("generate", prompts, **rollout.sampling())))
    finally:
        executor.get([executor.invoke(h, "set_rng_state", (s,), {}) for h, s in zip(infer.handles, states)])
    use(actor.role)
    trained, _ = log_probs(executor, actor, samples, rollout.temperature)
    return log_prob_gap(trained, samples["infer_log_probs"], samples["response_mask"])


def check_mismatch(gap: float, limit: float | None) -> None:
    """Raise :class:`MismatchError` when ``gap`` exceeds ``limit`` (None: no gate)."""
    if limit is None or gap <= limit:
        return
    raise MismatchError(
        f"at step 0 the training engine's log-probs of the inference engine's samples differ from the "
        f"inference engine's by {gap:.3g} per token on average, above trainer.max_initial_mismatch={limit:g}. "
        f"Both roles hold the same weights now, so the engines compute different distributions; usual causes: "
        f"different dtypes (bf16 against fp32) or attention kernels in roles.actor_train and roles.actor_infer, "
        f"weights that did not reach the engine (a model_path of its own, a failed weight sync), a tokenizer or "
        f"chat template that differs, or a temperature the log-probs do not apply. "
        f"Raise or unset the limit to train anyway.")
