"""The rollout's bookkeeping, by hand: dynamic sampling's counts and budget
(:mod:`roll_core.rollout.dynamic_sampling`), the step's batch metrics (:mod:`roll_core.rollout.metrics`)
and the core's own reward, ``exact_match`` (:mod:`roll_core.rewards`). The pipelines' tests run them
end to end; these pin each number (found wanting by mutation testing: ``docs/testing.md``)."""

from __future__ import annotations

import pytest
import torch

from roll_core.config.schema import DynamicSamplingConfig
from roll_core.data import Batch
from roll_core.rollout.dynamic_sampling import DynamicSampling
from roll_core.rollout.metrics import (accuracy_summary, batch_metrics, heldout_accuracy, idle_times,
                                       rows_by_domain)


# -- dynamic sampling ---------------------------------------------------------------------------
def test_the_budget_is_max_rounds_times_the_prompts_of_a_step():
    ds = DynamicSampling(DynamicSamplingConfig(filter="std", max_rounds=3), prompts_per_step=5)
    assert ds.budget == 15


def test_keep_counts_each_rejected_group_once_and_adds_up_over_calls():
    ds = DynamicSampling(DynamicSamplingConfig(filter="std"), prompts_per_step=3)
    # groups 0 (scores 1, 1: no spread), 1 (0, 1: kept) and 2 (0, 0: no spread): two rejected
    keep = ds.keep(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert keep.tolist() == [False, False, True, True, False, False]
    assert ds.filtered == 2
    ds.keep(torch.tensor([0.0, 0.0, 0.0]), torch.tensor([5, 5, 5]))  # one more group, rejected
    assert ds.filtered == 3
    ds.keep(torch.tensor([0.0, 1.0]), torch.tensor([6, 6]))  # kept: nothing added
    assert ds.filtered == 3


def test_exhausted_once_the_rejected_groups_reach_the_budget():
    ds = DynamicSampling(DynamicSamplingConfig(filter="std", max_rounds=2), prompts_per_step=2)
    ds.filtered = 3
    assert not ds.exhausted()
    ds.filtered = 4
    assert ds.exhausted()


def test_rounds_left_until_max_rounds_were_drawn():
    ds = DynamicSampling(DynamicSamplingConfig(filter="mean", max_rounds=2), prompts_per_step=4)
    assert ds.rounds_left()
    ds.rounds = 1
    assert ds.rounds_left()
    ds.rounds = 2
    assert not ds.rounds_left()


def test_metrics_report_the_counts_then_start_a_new_step():
    ds = DynamicSampling(DynamicSamplingConfig(filter="mean"), prompts_per_step=4)
    ds.filtered, ds.kept, ds.fallback, ds.rounds = 5, 4, 1, 3
    assert ds.metrics() == {"rollout/filtered_groups": 5.0, "rollout/kept_groups": 4.0,
                            "rollout/fallback_groups": 1.0, "rollout/sampling_rounds": 3.0}
    assert (ds.filtered, ds.kept, ds.fallback, ds.rounds) == (0, 0, 0, 0)
    # group by group (async) no rounds are counted, and none is reported
    ds.kept = 4
    assert ds.metrics() == {"rollout/filtered_groups": 0.0, "rollout/kept_groups": 4.0,
                            "rollout/fallback_groups": 0.0}


def test_without_a_filter_no_metrics_but_the_counts_still_reset():
    ds = DynamicSampling(DynamicSamplingConfig(), prompts_per_step=4)
    assert not ds.active
    ds.kept, ds.rounds = 4, 1
    assert ds.metrics() == {}
    assert (ds.kept, ds.rounds) == (0, 0)
    assert DynamicSampling(DynamicSamplingConfig(filter="std"), 4).active


# -- batch metrics --------------------------------------------------------------------------------
def scored_batch(scores, lengths, domains, *, truncated=None, components=None) -> Batch:
    width = max(lengths)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    tensors = {"scores": torch.tensor(scores), "response_mask": mask}
    if truncated is not None:
        tensors["truncated"] = torch.tensor(truncated)
    lists = {"domain": list(domains)}
    if components is not None:
        lists["reward_components"] = components
    return Batch(tensors, lists)


def test_batch_metrics_of_one_domain():
    # scores 1, 0, 0.5, 0.5: mean 0.5, unbiased std sqrt(0.5 / 3) = 0.408248; lengths 1, 2, 3, 6: mean 3
    batch = scored_batch([1.0, 0.0, 0.5, 0.5], [1, 2, 3, 6], ["default"] * 4, truncated=[False, False, True, False])
    out = batch_metrics(batch, per_domain=False)
    assert out == pytest.approx({"reward/mean": 0.5, "reward/std": 0.408248, "response_length/mean": 3.0,
                                 "response_length/clip_ratio": 0.25}, abs=1e-6)


def test_batch_metrics_of_a_single_sample_and_without_truncation_flags():
    out = batch_metrics(scored_batch([0.75], [2], ["default"]), per_domain=False)
    assert out == {"reward/mean": 0.75, "reward/std": 0.0, "response_length/mean": 2.0,
                   "response_length/clip_ratio": 0.0}
    # two samples have a spread: 1 and 0, unbiased std sqrt(0.5)
    assert batch_metrics(scored_batch([1.0, 0.0], [1, 1], ["d"] * 2), False)["reward/std"] == pytest.approx(0.707107)


def test_batch_metrics_per_domain_with_reward_components():
    # math: scores 1, 0 (accuracy 0.5), lengths 2, 4; code: 1.5, 0.5 (scores >= 1 count: 0.5), lengths 1, 1
    components = [{"a": 1.0, "b": 0.0}, {"a": 0.0, "b": 0.0}, {"only": 1.5}, {"only": 0.5}]
    batch = scored_batch([1.0, 0.0, 1.5, 0.5], [2, 4, 1, 1], ["math", "math", "code", "code"], components=components)
    out = batch_metrics(batch, per_domain=True)
    assert out["reward/math/mean"] == 0.5 and out["reward/math/accuracy"] == 0.5
    assert out["response_length/math/mean"] == 3.0 and out["samples/math"] == 2.0
    assert out["reward/code/mean"] == 1.0 and out["reward/code/accuracy"] == 0.5
    assert out["response_length/code/mean"] == 1.0 and out["samples/code"] == 2.0
    # the components' means, only for a domain scored by several rewards
    assert out["reward/math/a"] == 0.5 and out["reward/math/b"] == 0.0
    assert "reward/code/only" not in out
    assert out["reward/mean"] == 0.75  # the whole batch as well
    # a domain with one sample, scored by two rewards
    one = batch_metrics(scored_batch([0.5], [1], ["math"], components=[{"a": 0.25, "b": 0.25}]), per_domain=True)
    assert one["reward/math/a"] == 0.25 and one["reward/math/b"] == 0.25


def test_an_accuracy_of_exactly_one_counts_as_correct():
    out = batch_metrics(scored_batch([1.0, 0.999], [1, 1], ["a", "a"]), per_domain=True)
    assert out["reward/a/accuracy"] == 0.5


def test_rows_by_domain_sorts_the_domains_and_keeps_the_row_order():
    batch = scored_batch([0.0] * 4, [1] * 4, ["math", "code", "math", "code"])
    assert list(rows_by_domain(batch).items()) == [("code", [1, 3]), ("math", [0, 2])]


# -- held-out accuracy, idle times, the summary ---------------------------------------------------
class FixedScheduler:
    """A scheduler whose ``collect`` returns the given scores, recording how it was asked."""

    def __init__(self, scores, domains):
        self.batch = scored_batch(scores, [1] * len(scores), domains)
        self.asked = None

    def collect(self, rows, *, num_return_sequences, temperature):
        self.asked = (len(rows), num_return_sequences, temperature)
        return self.batch


class Failures:
    def __init__(self, failures):
        self.failures = failures

    def pop_failures(self):
        out, self.failures = self.failures, {}
        return out


def test_heldout_accuracy_is_greedy_one_sample_per_row_and_reports_nonzero_failures():
    scheduler = FixedScheduler([1.0, 0.0, 1.0, 1.0], ["default"] * 4)
    reward = Failures({"reward/timeouts": 2.0, "reward/nonfinite": 0.0})
    out = heldout_accuracy(scheduler, [{}] * 4, reward)
    assert scheduler.asked == (4, 1, 0.0)
    assert out == {"eval/accuracy": 0.75, "eval/reward/timeouts": 2.0}
    assert reward.failures == {}  # popped: the next RL step does not count them


def test_heldout_accuracy_per_domain_only_with_several():
    out = heldout_accuracy(FixedScheduler([1.0, 0.0, 0.0], ["math", "code", "math"]), [{}] * 3, Failures({}))
    assert out == pytest.approx({"eval/accuracy": 1 / 3, "eval/accuracy/code": 0.0, "eval/accuracy/math": 0.5})
    assert heldout_accuracy(FixedScheduler([1.0], ["math"]), [{}], Failures({})) == {"eval/accuracy": 1.0}


def test_idle_times_of_each_role():
    out = idle_times(step_s=1.0, train_s=0.5, old_log_probs_s=0.125, generate_s=0.25, overlapping=False)
    assert out == {"time/idle/actor_train_s": 0.375, "time/idle/actor_infer_s": 0.75}
    # overlapping generation's idle share is unknown; never below zero
    assert idle_times(1.0, 1.25, 0.0, 0.25, overlapping=True) == {"time/idle/actor_train_s": 0.0}
    assert idle_times(1.0, 0.5, 0.0, None, overlapping=False) == {"time/idle/actor_train_s": 0.5}
    assert idle_times(1.0, 0.5, 0.0, 1.5, overlapping=False)["time/idle/actor_infer_s"] == 0.0


def test_accuracy_summary_prints_the_gain(capsys):
    summary = accuracy_summary({"eval/accuracy": 0.5}, {"eval/accuracy": 0.875}, 200)
    assert summary == {"steps": 200, "before_rl": {"eval/accuracy": 0.5}, "after_rl": {"eval/accuracy": 0.875},
                       "accuracy_gain_pp": 37.5}
    assert capsys.readouterr().out == ("held-out accuracy (greedy): before RL 50.0% -> after RL 87.5% "
                                       "(+37.5 pp) after 200 RL steps\n")
    # the gain in points, to two decimals
    assert accuracy_summary({"eval/accuracy": 0.5}, {"eval/accuracy": 0.876543}, 1)["accuracy_gain_pp"] == 37.65
    capsys.readouterr()
    # no gain without both accuracies (a run without held-out rows, or one that stopped before the end)
    assert accuracy_summary({}, {}, 3) == {"steps": 3, "before_rl": {}, "after_rl": {}}
    assert "accuracy_gain_pp" not in accuracy_summary({"eval/accuracy": 0.5}, {}, 3)
    assert capsys.readouterr().out == ""


# -- the core's own reward ------------------------------------------------------------------------
def test_exact_match_strips_and_is_case_sensitive_by_default():
    from roll_core.rewards import ExactMatch, RewardInput

    def score(response, truth, **options):
        return ExactMatch(**options).score(RewardInput("p", response, truth))

    assert score(" 085\n", "085") == 1.0
    assert score(" 085\n", "085", strip=False) == 0.0 and score("085", "085", strip=False) == 1.0
    assert score("paris", "Paris") == 0.0
    assert score("paris", " Paris", case_sensitive=False) == 1.0
    assert score("85", 85) == 1.0  # a ground truth of another JSON type is compared as text


def test_a_reward_without_options_refuses_them_by_name():
    from roll_core.rewards import Reward

    class Plain(Reward):
        def score(self, sample):
            return 0.0

    with pytest.raises(TypeError, match=r"^Plain takes no options, got \['a', 'b'\]$"):
        Plain(b=1, a=2)
    assert Plain().score_batch([None, None]) == [0.0, 0.0]
