"""The update loop (``roll_core.training``) against a strategy that records what it is asked: how
epochs and mini-batches become optimizer steps, what each step is given, and how metrics are
reduced over micro-batches, steps and data-parallel ranks. Pure and fast; the same loop on a real
model is in ``test_grad_accumulation.py`` and ``test_packing.py``."""

from __future__ import annotations

import math

import pytest
import torch

from roll_core import training
from roll_core.algorithms.objective import loss_denominators
from roll_core.config import load_config
from roll_core.testing import training_batch
from roll_core.training import UpdateSpec, reduce_over_ranks, update


class LossFn:
    additive = frozenset({"p/loss"})


class Recorder:
    """A training strategy on ``world`` data-parallel ranks (this one rank 0) whose gradient norms
    are ``norms`` in turn. Its ``k``-th forward-backward call (from 1) returns two micro-batches'
    metrics: ``p/loss`` ``k`` and 1 (additive: they add up), ``p/mean`` ``k`` and 0 (averaged)."""

    def __init__(self, norms: list[float], world: int = 1):
        self.norms, self.world = list(norms), world
        self.log: list[tuple] = []

    def data_parallel(self):
        return 0, self.world

    def data_parallel_group(self):
        return "the group"

    def zero_grad(self):
        self.log.append(("zero_grad",))

    def forward_backward(self, mini, loss_fn, *, micro_batch_size, denominators):
        self.log.append(("forward_backward", mini["index"].tolist(), micro_batch_size, denominators))
        k = sum(entry[0] == "forward_backward" for entry in self.log)
        return [{"p/loss": float(k), "p/mean": float(k)}, {"p/loss": 1.0, "p/mean": 0.0}]

    def apply_gradients(self, max_grad_norm, optimizer, lr):
        self.log.append(("apply_gradients", max_grad_norm, optimizer, lr))
        return self.norms.pop(0)


def indexed_batch():
    batch = training_batch(50)
    batch.tensors["index"] = torch.arange(len(batch))
    return batch


def test_epochs_times_mini_batches_are_the_optimizer_steps_and_metrics_average_over_them():
    batch = indexed_batch()
    strategy = Recorder(norms=[1.0, 2.0, 3.0, 6.0])
    spec = UpdateSpec(max_grad_norm=0.5, micro_batch_size=2, epochs=2, mini_batch_size=4, optimizer="warm-up",
                      lr=0.1, metric_prefix="p")
    metrics = update(strategy, batch, LossFn(), spec)

    halves = [list(range(4)), list(range(4, 8))]
    expected = []
    for rows in halves * 2:  # two epochs over the same two mini-batches, in order
        denominators = loss_denominators(batch.select(slice(rows[0], rows[-1] + 1)))
        expected += [("zero_grad",), ("forward_backward", rows, 2, denominators),
                     ("apply_gradients", 0.5, "warm-up", 0.1)]
    assert strategy.log == expected
    # step k's micro-batches: loss k + 1 (summed), mean k / 2 (averaged); then averaged over the 4 steps
    assert metrics == {"p/loss": pytest.approx((2 + 3 + 4 + 5) / 4), "p/mean": pytest.approx((1 + 2 + 3 + 4) / 8),
                       "p/grad_norm": pytest.approx(3.0), "p/skipped_updates": 0.0}


def test_without_a_mini_batch_size_the_whole_batch_is_one_step():
    batch = indexed_batch()
    strategy = Recorder(norms=[4.0])
    metrics = update(strategy, batch, LossFn(), UpdateSpec(max_grad_norm=1.0, micro_batch_size=8))
    assert [entry[0] for entry in strategy.log] == ["zero_grad", "forward_backward", "apply_gradients"]
    assert strategy.log[1][1] == list(range(8))
    assert strategy.log[2] == ("apply_gradients", 1.0, "default", None)
    assert metrics["train/grad_norm"] == 4.0 and metrics["train/skipped_updates"] == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_every_step_with_a_non_finite_gradient_norm_is_counted_as_skipped(bad):
    strategy = Recorder(norms=[bad, 2.0, bad, bad])
    metrics = update(strategy, indexed_batch(), LossFn(), UpdateSpec(max_grad_norm=1.0, micro_batch_size=2,
                                                                     mini_batch_size=2))
    assert metrics["train/skipped_updates"] == 3.0
    assert not math.isfinite(metrics["train/grad_norm"])  # the average reports that a step had none


def test_on_several_ranks_each_takes_its_share_of_every_mini_batch_and_metrics_are_reduced(monkeypatch):
    """Two ranks that computed the same: the mini-batch's denominators and the additive metrics
    sum over both, the others average back to one rank's."""
    calls = []

    def two_equal_ranks(values, group=None):
        calls.append(group)
        return [2 * v for v in values]

    monkeypatch.setattr(training, "all_reduce_sum", two_equal_ranks)
    batch = indexed_batch()
    strategy = Recorder(norms=[1.0, 3.0], world=2)
    metrics = update(strategy, batch, LossFn(), UpdateSpec(max_grad_norm=1.0, micro_batch_size=2,
                                                           mini_batch_size=8))
    passes = [entry for entry in strategy.log if entry[0] == "forward_backward"]
    assert [p[1] for p in passes] == [list(range(4)), list(range(4, 8))]  # 8 samples over 2 ranks: 4 each
    tokens, seqs = loss_denominators(batch.select(slice(0, 4)))
    assert passes[0][3] == (2 * tokens, 2 * seqs)
    assert set(calls) == {"the group"}
    assert metrics == {"train/grad_norm": pytest.approx(2.0), "p/loss": pytest.approx(2 * (2 + 3) / 2),
                       "p/mean": pytest.approx((0.5 + 1) / 2), "train/skipped_updates": 0.0}


def test_reduce_over_ranks_sums_loss_shares_and_averages_the_rest(monkeypatch):
    seen = []

    def totals(values, group=None):
        seen.append((list(values), group))
        return [10.0, 20.0, 30.0]  # the sums for the keys in sorted order: a, b, c

    monkeypatch.setattr(training, "all_reduce_sum", totals)
    metrics = {"c": 3.0, "a": 1.0, "b": 2.0}
    assert reduce_over_ranks(metrics, frozenset({"b"}), 4, group="g") == {"a": 2.5, "b": 20.0, "c": 7.5}
    assert seen == [([1.0, 2.0, 3.0], "g")]
    assert reduce_over_ranks(metrics, frozenset({"b"}), 1) is metrics  # one rank: nothing to reduce
    assert len(seen) == 1


def test_an_update_spec_from_the_config_takes_the_algorithm_s_schedule_and_the_role_s_micro_batches():
    cfg = load_config(None, ["algorithm.ppo_epochs=3", "algorithm.ppo_mini_batch_size=128",
                             "algorithm.max_grad_norm=0.7", "roles.actor_train.micro_batch_size=4"])
    spec = UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train)
    assert spec == UpdateSpec(max_grad_norm=0.7, micro_batch_size=4, epochs=3, mini_batch_size=128,
                              optimizer="default", lr=None, metric_prefix="train")
    assert UpdateSpec.from_config(cfg.algorithm, cfg.roles.actor_train, "critic").metric_prefix == "critic"
