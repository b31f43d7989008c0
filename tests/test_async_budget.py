"""The async scheduler's bookkeeping, worked out by hand: which groups may start under the staleness
bound (:class:`StalenessBudget`) and each domain's share of a batch (:class:`DomainLanes`). The
pipeline tests in ``test_async.py`` check the bound's consequences on whole runs; these pin the
arithmetic itself in milliseconds."""

from collections import Counter

import pytest

from roll_core.data import Batch
from roll_core.rollout.async_scheduler import DomainLanes, StalenessBudget


@pytest.mark.parametrize("ratio, max_stale", [(0, 0), (0.5, 1), (1, 1), (1.5, 2)])
def test_the_bound_is_the_ratio_rounded_up(ratio, max_stale):
    assert StalenessBudget(ratio=ratio, want=4, extra=0).max_stale == max_stale


def test_staleness_counts_the_updates_between_a_groups_weights_and_the_step_that_trains_it():
    # step s trains on weights s - 1: a group of version 0 trained at step 1 is fresh, one of version
    # 1 trained at step 4 is two updates old
    assert StalenessBudget.staleness(0, 1) == 0 and StalenessBudget.staleness(1, 4) == 2
    one = StalenessBudget(ratio=1, want=4, extra=0)
    assert not one.too_stale(1, 3) and one.too_stale(0, 3)  # staleness 1 is allowed, 2 is not
    synchronous = StalenessBudget(ratio=0, want=4, extra=0)
    assert not synchronous.too_stale(0, 1) and synchronous.too_stale(0, 2)


# admissible = max(0, limit + (extra if limit > 0) - outstanding), limit = floor((1 + ratio + version - steps) * want)
@pytest.mark.parametrize("ratio, want, extra, version, steps, outstanding, expected", [
    (0, 4, 0, 0, 0, 0, 4),      # synchronous: the first batch's groups
    (0, 4, 0, 0, 0, 3, 1),      # three of them already out
    (0, 4, 0, 0, 0, 6, 0),      # more out than the bound allows: none, never a negative count
    (0, 4, 2, 0, 1, 0, 0),      # batch 1 taken, its weights not yet pushed: nothing starts, no redundant one either
    (0, 4, 2, 1, 1, 0, 6),      # the weights arrived: the next batch and its two redundant groups
    (0.5, 4, 2, 0, 0, 0, 8),    # half a batch ahead: floor(1.5 * 4) + 2
    (0.5, 4, 2, 0, 1, 3, 1),    # floor(0.5 * 4) + 2 - 3
    (2, 3, 1, 0, 3, 0, 0),      # three batches taken on version 0 with ratio 2: the bound is reached
    (0.4, 45, 0, 0, 0, 0, 63),  # 1.4 * 45 is 62.99999999999999 in floats, and 63 groups fit
])
def test_admissible_groups(ratio, want, extra, version, steps, outstanding, expected):
    budget = StalenessBudget(ratio=ratio, want=want, extra=extra, version=version, steps_started=steps)
    assert budget.admissible(outstanding) == expected


def _lanes() -> DomainLanes:
    """Three quarters math, a quarter code, two groups a batch. Deficit round-robin, by hand (credit
    after each slot; a tie goes to the later name): step 1 math (-.25), math (-.5; .5 against code's
    .5); step 2 code (.75 -> -.25), math (1.0 -> 0); then the same again."""
    return DomainLanes({"math": 0.75, "code": 0.25}, want=2)


def test_each_steps_quota_deals_the_shares_over_its_slots_and_keeps_them():
    lanes = _lanes()
    assert lanes.quota(3) == {"math": 2, "code": 0}  # the steps before it are dealt first
    assert [lanes.quota(s) for s in (1, 2, 4)] == [{"math": 2, "code": 0}, {"math": 1, "code": 1},
                                                  {"math": 1, "code": 1}]
    assert lanes.quota(1) == {"math": 2, "code": 0}  # asked again: the same, not dealt anew


def test_the_neediest_domain_is_furthest_below_the_coming_batches_and_its_redundant_share():
    lanes = _lanes()
    assert lanes.neediest(1, 2, 0, Counter()) == "math"  # steps 1-2 need math 3, code 1
    assert lanes.neediest(1, 2, 0, Counter(math=3)) == "code"
    # with 2 redundant groups: math 3 + ceil(1.5) - 3 = 2 against code 1 + ceil(0.5) - 1 = 1
    assert lanes.neediest(1, 2, 2, Counter(math=3, code=1)) == "math"
    assert lanes.neediest(2, 1, 0, Counter(math=1)) == "code"  # step 2 alone: one of each
    assert lanes.neediest(2, 1, 0, Counter()) == "math"  # equal deficits: the larger share
    # the larger share, not the later name: "a" (3/4) and "b" (1/4) in a batch of 4, dealt a, b (a tie
    # at .5), a, a; with two of a's three out, each lacks one
    named = DomainLanes({"a": 0.75, "b": 0.25}, want=4)
    assert named.quota(1) == {"a": 3, "b": 1} and named.neediest(1, 1, 0, Counter(a=2)) == "a"
    # a redundant share rounds up: with 2 redundant groups over halves and quarters, b's half a group
    # counts as one (b: 1 + 1 - 0 = 2 against a: 2 + 1 - 2 = 1); rounded down, a would win the tie
    quarters = DomainLanes({"a": 0.5, "b": 0.25, "c": 0.25}, want=4)
    assert quarters.quota(1) == {"a": 2, "b": 1, "c": 1} and quarters.neediest(1, 1, 2, Counter(a=2, c=1)) == "b"


def test_a_group_fits_a_batch_while_its_domains_quota_has_room():
    lanes = _lanes()
    math, code = (Batch(non_tensors={"domain": [d, d]}) for d in ("math", "code"))
    assert lanes.fits(math, [], 1) and not lanes.fits(code, [], 1)  # step 1 holds no code
    assert lanes.fits(math, [(0, math)], 1) and not lanes.fits(math, [(0, math), (1, math)], 1)
    assert lanes.fits(code, [(0, math)], 2) and not lanes.fits(code, [(0, code)], 2)
    assert not lanes.fits(Batch(non_tensors={"domain": ["poetry"]}), [], 1)  # no lane, no room
