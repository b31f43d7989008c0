"""Rollout schedulers: turn prompt rows into the scored groups of samples that a step trains on.

One interface for every scheduler, called by the pipeline in this order::

    start(stream, reference)            once, before the first step
    next_batch()          -> (batch, metrics)   every step: the groups to train on
    wait(future)          -> result     while the trainer works (a scheduler may generate meanwhile)
    weights_pushed()                    after each weight update was queued on the inference workers
    [prefetch()]                        maybe, after weights_pushed: send the next step's requests now
    stop()                              once, at the end: nothing stays in flight

plus ``collect(rows, ...)`` for one-off generation (held-out evaluation). The built-in ``sync``
scheduler is the trivial case: ``next_batch`` generates and scores the step's groups (with dynamic
sampling, :mod:`roll_core.rollout.dynamic_sampling`), ``wait`` just waits. The asynchronous ``async``
scheduler (after ROLL Flash) keeps generating while the trainer works.

Whether a scheduler generates while training runs is registration metadata, not a name check::

    register("mine", "my_pkg.sched:MyScheduler", overlaps_training=True)

A scheduler that overlaps training gets inference devices disjoint from actor_train (checked at
config load), its weight updates are queued behind the requests already sent (not waited for), and
its reference log-probs may be computed as groups complete.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from roll_core.data import Batch


class RolloutScheduler(ABC):
    """Constructed as ``cls(config, executor, infer_group, reward_router, tokenizer)``; ``reward_router``
    is a :class:`roll_core.rollout.rewards.RewardRouter`."""

    def __init__(self, config, executor, infer_group, reward_router, tokenizer):
        self.config, self.executor = config, executor
        self.infer, self.reward = infer_group, reward_router
        self.tokenizer = tokenizer
        self.stream: Any = None
        self.reference = None

    def start(self, stream, reference=None) -> None:
        """Draw training prompts from ``stream`` (a :class:`~roll_core.data.PromptStream` or
        :class:`~roll_core.data.DomainMixer`). ``reference`` is the reference role's worker group when
        the scheduler may compute ``ref_log_probs`` itself as groups complete (only offered to
        schedulers that overlap training, when the reference has devices of its own)."""
        self.stream, self.reference = stream, reference

    @abstractmethod
    def next_batch(self) -> tuple[Batch, dict[str, float]]:
        """The next step's batch: ``rollout.prompts_per_step`` groups of ``num_return_sequences``
        samples (group ids ``0..prompts_per_step-1`` in order), after dynamic sampling, and the step's
        rollout metrics (names in ``docs/design.md``, "Metrics")."""

    @abstractmethod
    def collect(self, rows: list[dict], *, num_return_sequences: int, temperature: float) -> Batch:
        """Generate ``num_return_sequences`` responses per row, score them and return the batch with
        ``prompt_ids``, ``prompt_mask``, ``responses``, ``response_mask``, ``infer_log_probs``,
        ``token_level_rewards`` ``[B, R]``, ``scores`` ``[B]``, ``group_index`` ``[B]`` and ``truncated``
        ``[B]`` (bool: cut off at ``max_new_tokens`` without an id that ends a response)."""

    def wait(self, future):
        """The result of ``future`` (a training call); a scheduler that overlaps training keeps
        generating and scoring until it is done."""
        return self.executor.get(future)

    def weights_pushed(self) -> None:
        """A weight update has been queued on every inference worker (requests sent before it finish
        with the old weights)."""

    def prefetch(self) -> None:
        """Send the next step's first generation requests now, behind the weight update just queued
        on every inference worker (each runs its calls in order, so they sample from the updated
        policy). The pipeline calls it only where that order holds and a step follows that no
        checkpoint precedes: the samples and every random draw are those the next
        :meth:`next_batch` would have made, and generation overlaps the driver's work in between.
        The default sends nothing."""

    def stop(self) -> None:
        """End of the run: abort or finish whatever is in flight, so no request outlives it."""


def overlaps_training(name: str, plugins) -> bool:
    """Whether scheduler ``name`` was registered with ``overlaps_training=True``."""
    return bool(plugins.schedulers.entry(name).metadata.get("overlaps_training", False))
