"""The update loop of every trained role, on its strategy's engine primitives.

A training strategy (:class:`roll_core.strategy.TrainStrategy`) only knows how to run its model:
``forward``, ``forward_backward`` over the micro-batches of a mini-batch with a loss function passed
in, ``apply_gradients`` (clip, then step or skip) and ``zero_grad``. What an *update* is lives here, once:

    for epoch in range(epochs):
        for mini-batch in batch (``mini_batch_size`` samples over all data-parallel ranks):
            denominators = tokens and sequences of the mini-batch, summed over ranks
            forward_backward(mini-batch, loss)            # gradients of the mini-batch loss
            norm = apply_gradients(max_grad_norm)         # clip; step if the norm is finite, else
                                                          # drop: a NaN loss never reaches the weights

so PPO's epochs and mini-batches, SFT's single step and a DPO or distillation loss all run on the
same primitives, and a strategy with its own schedule (Megatron's pipeline-parallel
``forward_backward_func``) only implements ``forward_backward``. Metrics come back reduced over
micro-batches, updates and ranks: the loss's ``additive`` metrics (shares of the mini-batch loss)
add up, every other metric is averaged.

Runs inside the worker that hosts the strategy (``TrainWorker.update``); the local executor runs
it in the driver. The loss function and :class:`UpdateSpec` come from the driver, resolved once.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from roll_core.algorithms.objective import ActorObjective, LossFn, loss_denominators
from roll_core.data import Batch
from roll_core.runtime.distributed import all_reduce_max, all_reduce_sum


@dataclass(frozen=True)
class UpdateSpec:
    """How one call to :func:`update` optimises.

    ``mini_batch_size`` counts samples over all data-parallel ranks (None: the whole batch is one
    optimizer step); ``micro_batch_size`` is per forward-backward pass on one rank; ``optimizer``
    names the strategy's optimizer (a phase with its own moments, such as the supervised warm-up,
    uses its own) and ``lr``, when given, sets its learning rate."""

    max_grad_norm: float
    micro_batch_size: int
    epochs: int = 1
    mini_batch_size: int | None = None
    optimizer: str = "default"
    lr: float | None = None
    metric_prefix: str = "train"

    @classmethod
    def from_config(cls, algorithm, role, prefix: str = "train") -> UpdateSpec:
        """PPO's update: ``algorithm.ppo_epochs`` x ``ppo_mini_batch_size`` of the role's micro-batches."""
        return cls(max_grad_norm=algorithm.max_grad_norm, micro_batch_size=role.micro_batch_size,
                   epochs=algorithm.ppo_epochs, mini_batch_size=algorithm.ppo_mini_batch_size, metric_prefix=prefix)


def policy_gradient_update(cfg, plugins) -> tuple[ActorObjective, UpdateSpec]:
    """actor_train's update in the policy-gradient pipelines (rlvr, agentic; their
    ``policy_update``): the configured objective, every registered callable resolved once (it
    travels with each update), and PPO's epochs and mini-batches."""
    return (ActorObjective.from_config(cfg.algorithm, cfg.rollout, plugins),
            UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train))


def _combine(per_micro: list[dict[str, float]], additive: frozenset[str]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for metrics in per_micro:
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value
    return {k: v if k in additive else v / len(per_micro) for k, v in totals.items()}


def micro_batches(mini: Batch, size: int, max_tokens: int | None = None, group=None) -> list[Batch]:
    """The forward-backward passes of one mini-batch (this rank's share), in order.

    Without ``max_tokens``, ``size`` samples each. With it, sized by tokens (a sample's prompt plus
    response tokens, no padding): consecutive samples fill a part up to ``max_tokens`` (a longer
    sample is a part of its own). Every data-parallel rank (``group``) runs as many passes as the
    rank that needs the most, so a rank that needs fewer halves its largest parts until it has as many."""
    if max_tokens is None:
        return mini.split(size)
    tokens = mini.sample_tokens().tolist()
    prefix = [0]
    for n in tokens:
        prefix.append(prefix[-1] + n)
    bounds: list[tuple[int, int]] = []
    for i in range(len(tokens)):
        if bounds and prefix[i + 1] - prefix[bounds[-1][0]] <= max_tokens:
            bounds[-1] = (bounds[-1][0], i + 1)
        else:
            bounds.append((i, i + 1))
    parts = min(all_reduce_max(len(bounds), group), len(tokens))
    while len(bounds) < parts:
        widest = max((k for k, (a, b) in enumerate(bounds) if b - a > 1),
                     key=lambda k: prefix[bounds[k][1]] - prefix[bounds[k][0]])
        a, b = bounds[widest]
        middle = bisect.bisect_left(prefix, (prefix[a] + prefix[b]) / 2, lo=a + 1, hi=b - 1)
        bounds[widest:widest + 1] = [(a, middle), (middle, b)]
    return [mini.select(slice(a, b)) for a, b in bounds]


def accumulate_gradients(strategy, mini: Batch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
    """Gradients of ``loss_fn`` over the mini-batch ``mini`` (this rank's share), no optimizer step.

    The loss denominators are counted over the whole mini-batch before it is split, and summed over
    the ranks, so the accumulated and rank-summed gradient is that of the mini-batch loss whatever
    ``micro_batch_size`` and the number of ranks are."""
    tokens, seqs = all_reduce_sum(list(loss_denominators(mini)), strategy.data_parallel_group())
    per_micro = strategy.forward_backward(mini, loss_fn, micro_batch_size=micro_batch_size,
                                          denominators=(tokens, seqs))
    return _combine(per_micro, loss_fn.additive)


def reduce_over_ranks(metrics: dict[str, float], additive: frozenset[str], world: int,
                      group=None) -> dict[str, float]:
    """Whole-batch metrics from per-rank ones (``world`` data-parallel ranks forming ``group``): loss
    shares add up, everything else is averaged (values equal on every rank, like the gradient norm,
    stay as they are)."""
    if world == 1:
        return metrics
    keys = sorted(metrics)
    totals = all_reduce_sum([metrics[k] for k in keys], group)
    return {k: t if k in additive else t / world for k, t in zip(keys, totals)}


def update(strategy, batch: Batch, loss_fn: LossFn, spec: UpdateSpec) -> dict[str, float]:
    """Optimise ``loss_fn`` on ``batch``, this rank's share (``1 / world`` of every mini-batch, in
    order: :func:`roll_core.data.dp_shards`). Returns the metrics averaged over optimizer steps,
    with ``<prefix>/grad_norm`` and ``<prefix>/skipped_updates`` (non-finite gradient norms)."""
    world = strategy.data_parallel()[1]
    size = spec.mini_batch_size // world if spec.mini_batch_size else len(batch)
    sums: dict[str, float] = {}
    updates = skipped = 0
    for _ in range(spec.epochs):
        for mini in batch.split(size):
            strategy.zero_grad()
            metrics = accumulate_gradients(strategy, mini, loss_fn, spec.micro_batch_size)
            grad_norm = strategy.apply_gradients(spec.max_grad_norm, spec.optimizer, spec.lr)
            if not math.isfinite(grad_norm):  # the strategy dropped the step: report it
                skipped += 1
            metrics[f"{spec.metric_prefix}/grad_norm"] = grad_norm
            updates += 1
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value
    out = {k: v / updates for k, v in sums.items()}
    out[f"{spec.metric_prefix}/skipped_updates"] = float(skipped)
    return reduce_over_ranks(out, loss_fn.additive, world, strategy.data_parallel_group())
