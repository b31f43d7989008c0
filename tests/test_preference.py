"""Preference losses against numbers computed by hand (DPO sigmoid with label smoothing, IPO, and a
reward model's Bradley-Terry loss, SimPO), and the pairs online DPO draws from scored groups."""

import math

import pytest
import torch

from roll_core.algorithms.preference import (PreferenceInput, best_worst_pairs, bradley_terry, dpo_sigmoid, ipo,
                                             simpo)

# Pair 0: chosen log-ratio -1.0 - (-1.5) = 0.5, rejected -2.0 - (-1.0) = -1.0, so h = 1.5.
# Pair 1: chosen log-ratio -0.2, rejected 0.3, so h = -0.5 (the policy prefers the rejected one).
PAIRS = PreferenceInput(policy_chosen=torch.tensor([-1.0, -1.2]), policy_rejected=torch.tensor([-2.0, -0.7]),
                        reference_chosen=torch.tensor([-1.5, -1.0]), reference_rejected=torch.tensor([-1.0, -1.0]))


def test_dpo_sigmoid_is_minus_log_sigmoid_of_beta_h():
    loss, metrics = dpo_sigmoid(PAIRS, beta=0.1)
    # -log sigmoid(0.15) = log(1 + e^-0.15) = 0.620957 ; -log sigmoid(-0.05) = log(1 + e^0.05) = 0.718460
    torch.testing.assert_close(loss, torch.tensor([0.620957, 0.718460]), atol=1e-6, rtol=0)
    assert metrics["rewards/chosen"] == pytest.approx((0.05 - 0.02) / 2)
    assert metrics["rewards/rejected"] == pytest.approx((-0.1 + 0.03) / 2)
    assert metrics["rewards/margin"] == pytest.approx((0.15 - 0.05) / 2)
    assert metrics["rewards/accuracy"] == 0.5


def test_dpo_label_smoothing_mixes_in_the_flipped_label():
    loss, _ = dpo_sigmoid(PAIRS, beta=0.1, label_smoothing=0.2)
    # 0.8 * log(1 + e^-0.15) + 0.2 * log(1 + e^0.15) = 0.8 * 0.620957 + 0.2 * 0.770957
    assert float(loss[0]) == pytest.approx(0.8 * 0.620957 + 0.2 * 0.770957, abs=1e-6)


def test_dpo_gradient_raises_the_chosen_and_lowers_the_rejected():
    policy_chosen = PAIRS.policy_chosen.clone().requires_grad_()
    policy_rejected = PAIRS.policy_rejected.clone().requires_grad_()
    inputs = PreferenceInput(policy_chosen, policy_rejected, PAIRS.reference_chosen, PAIRS.reference_rejected)
    dpo_sigmoid(inputs, beta=0.1)[0].sum().backward()
    # d/dh -log sigmoid(beta h) = -beta sigmoid(-beta h): beta * sigmoid(-0.15) = 0.1 * 0.462570
    assert float(policy_chosen.grad[0]) == pytest.approx(-0.1 / (1 + math.exp(0.15)), abs=1e-7)
    assert float(policy_rejected.grad[0]) == pytest.approx(0.1 / (1 + math.exp(0.15)), abs=1e-7)


def test_ipo_regresses_the_gap_onto_one_over_two_beta():
    loss, metrics = ipo(PAIRS, beta=0.1)
    # (1.5 - 5)^2 = 12.25 ; (-0.5 - 5)^2 = 30.25
    torch.testing.assert_close(loss, torch.tensor([12.25, 30.25]))
    assert metrics["rewards/accuracy"] == 0.5
    # at the target gap the loss is 0, and beyond it the loss pulls the gap back
    at_target = PreferenceInput(torch.tensor([5.0]), torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0]))
    assert float(ipo(at_target, beta=0.1)[0]) == 0.0


def test_bradley_terry_is_minus_log_sigmoid_of_the_score_gap():
    chosen = torch.tensor([1.0, 0.0], requires_grad=True)
    rejected = torch.tensor([0.0, 2.0])
    loss, metrics = bradley_terry(chosen, rejected)
    # -log sigmoid(1) = log(1 + e^-1) = 0.313262 ; -log sigmoid(-2) = log(1 + e^2) = 2.126928
    torch.testing.assert_close(loss, torch.tensor([0.313262, 2.126928]), atol=1e-6, rtol=0)
    assert metrics == pytest.approx({"rewards/chosen": 0.5, "rewards/rejected": 1.0, "rewards/margin": -0.5,
                                     "rewards/accuracy": 0.5})
    loss.sum().backward()
    # d/dr_c -log sigmoid(r_c - r_r) = -sigmoid(r_r - r_c): -1/(1 + e) and -1/(1 + e^-2)
    torch.testing.assert_close(chosen.grad, torch.tensor([-1 / (1 + math.e), -1 / (1 + math.exp(-2))]))
    shifted, _ = bradley_terry(chosen.detach() + 3.0, rejected + 3.0)  # a constant on every score changes nothing
    torch.testing.assert_close(shifted, loss.detach())


def test_best_worst_pairs_take_each_groups_top_and_bottom_score_and_skip_ties():
    # groups (in row order) 2, 0, 2, 1, 0, 2, 1, 3, 3; group 1 ties, group 3 holds a NaN
    group = torch.tensor([2, 0, 2, 1, 0, 2, 1, 3, 3])
    scores = torch.tensor([0.5, 0.0, 1.0, 1.0, 1.0, 0.5, 1.0, float("nan"), 1.0])
    # group 0: rows 1 (0.0), 4 (1.0) -> (4, 1); group 2: rows 0, 2, 5 -> best 2, worst 0 (the earlier of two 0.5s)
    assert best_worst_pairs(scores, group).tolist() == [[4, 1], [2, 0]]
    assert best_worst_pairs(torch.ones(4), torch.tensor([0, 0, 1, 1])).shape == (0, 2)
    assert best_worst_pairs(torch.tensor([3, 1, 2]), torch.zeros(3, dtype=torch.long)).tolist() == [[0, 1]]
    assert best_worst_pairs(torch.tensor([0, 2, 2]), torch.zeros(3, dtype=torch.long)).tolist() == [[1, 0]]
    # masked rows take no part: group 0 keeps only row 4 (no pair); group 2 without its best (row 2)
    # ties at 0.5 (none); group 3 without its NaN keeps one row (none)
    keep = torch.tensor([1, 0, 0, 1, 1, 1, 1, 0, 1], dtype=torch.bool)
    assert best_worst_pairs(scores, group, keep).shape == (0, 2)
    keep[1] = True  # group 0 whole again
    assert best_worst_pairs(scores, group, keep).tolist() == [[4, 1]]
    scores[5] = 0.75  # group 2 without row 2: 0.75 over 0.5
    assert best_worst_pairs(scores, group, keep).tolist() == [[4, 1], [5, 0]]
    assert best_worst_pairs(scores, group, torch.ones(9, dtype=torch.bool)).tolist() == [[4, 1], [2, 0]]


def test_simpo_ignores_the_reference_and_asks_for_a_margin_of_gamma():
    # policy gaps h' = -1.0 - (-2.0) = 1.0 and -1.2 - (-0.7) = -0.5; beta 2, gamma 0.5: logits 1.5 and -1.5
    loss, metrics = simpo(PAIRS, beta=2.0, gamma=0.5)
    torch.testing.assert_close(loss, torch.tensor([math.log1p(math.exp(-1.5)), math.log1p(math.exp(1.5))]))
    assert metrics == pytest.approx({"rewards/chosen": -2.2, "rewards/rejected": -2.7, "rewards/margin": 0.5,
                                     "rewards/accuracy": 0.5})
    moved = PreferenceInput(PAIRS.policy_chosen, PAIRS.policy_rejected, PAIRS.reference_chosen + 5.0, torch.zeros(2))
    torch.testing.assert_close(simpo(moved, beta=2.0, gamma=0.5)[0], loss)  # no reference read
    torch.testing.assert_close(simpo(PAIRS, beta=2.0)[0], loss)  # gamma 0.5 by default
    smoothed, _ = simpo(PAIRS, beta=2.0, gamma=0.5, label_smoothing=0.25)
    torch.testing.assert_close(smoothed[0], torch.tensor(0.75 * math.log1p(math.exp(-1.5))
                                                         + 0.25 * math.log1p(math.exp(1.5))))


@pytest.mark.parametrize("loss, setting, averaged", [("dpo_sigmoid", None, False), ("ipo", None, False),
                                                     ("simpo", None, True), ("simpo", False, False),
                                                     ("dpo_sigmoid", True, True)])
def test_per_token_means_are_the_losss_own_choice_unless_the_config_says(loss, setting, averaged):
    from roll_core.algorithms.objective import PreferenceObjective
    from roll_core.config.schema import DPOConfig

    objective = PreferenceObjective.from_config(DPOConfig(loss=loss, average_log_probs=setting))
    assert objective.average_log_probs is averaged
