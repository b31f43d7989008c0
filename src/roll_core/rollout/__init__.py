"""Rollout schedulers: turn prompt rows into scored groups of samples.

The interface is deliberately small: ``collect(rows, ...) -> Batch``. The built-in ``sync`` scheduler
generates the step's groups on the inference workers and scores each generation request on the
reward workers of its domain as soon as it finishes (:mod:`roll_core.rollout.rewards`); the
asynchronous, sample-level scheduler (ROLL Flash) registers under the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from roll_core.data import Batch


class RolloutScheduler(ABC):
    """Constructed as ``cls(config, executor, infer_group, reward_router, tokenizer)``; ``reward_router``
    is a :class:`roll_core.rollout.rewards.RewardRouter`. ``last_metrics`` holds the timings of the
    latest ``collect`` (``time/...`` keys), which the pipeline logs."""

    def __init__(self, config, executor, infer_group, reward_router, tokenizer):
        self.config, self.executor = config, executor
        self.infer, self.reward = infer_group, reward_router
        self.tokenizer = tokenizer
        self.last_metrics: dict[str, float] = {}

    @abstractmethod
    def collect(self, rows: list[dict], *, num_return_sequences: int, temperature: float) -> Batch:
        """Generate ``num_return_sequences`` responses per row, score them and return the batch with
        ``prompt_ids``, ``prompt_mask``, ``responses``, ``response_mask``, ``infer_log_probs``,
        ``token_level_rewards`` ``[B, R]``, ``scores`` ``[B]``, ``group_index`` ``[B]`` and ``truncated``
        ``[B]`` (bool: cut off at ``max_new_tokens`` without EOS)."""
