"""Algorithms against numbers computed by hand (the arithmetic is in the comments)."""

import math
from types import SimpleNamespace

import pytest
import torch

from roll_core.algorithms.advantages import (
    AdvantageInput, discounted_returns, grpo, reinforce_plus_plus, rloo,
)
from roll_core.algorithms.kl import k1, k2, k3
from roll_core.algorithms.losses import PolicyLossInput, aggregate, ppo_clip, vanilla_pg

EPS = 1e-6


def cfg(**kw):
    base = dict(norm_adv_by_std=True, gamma=1.0, clip_ratio_low=0.2, clip_ratio_high=0.2)
    return SimpleNamespace(**{**base, **kw})


def outcome(scores, width=2):
    """Scores on the last token of full-width responses."""
    r = torch.zeros(len(scores), width)
    r[:, -1] = torch.tensor(scores, dtype=torch.float32)
    return r


def test_grpo_two_groups():
    # group 0: rewards 1, 0  -> mean 0.5, unbiased std sqrt(((.5)^2 + (.5)^2) / 1) = 0.70711
    #   A = +-0.5 / 0.70711 = +-0.70711
    # group 1: rewards 1, 1, 0 -> mean 2/3, std sqrt((1/9 + 1/9 + 4/9) / 2) = sqrt(1/3) = 0.57735
    #   A = (1/3) / 0.57735 = 0.57735 ; (-2/3) / 0.57735 = -1.15470
    mask = torch.ones(5, 2)
    adv, ret = grpo(AdvantageInput(outcome([1, 0, 1, 1, 0]), mask, torch.tensor([0, 0, 1, 1, 1])), cfg())
    expected = torch.tensor([0.70711, -0.70711, 0.57735, 0.57735, -1.15470])
    torch.testing.assert_close(adv[:, 0], expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(adv[:, 1], expected, atol=1e-4, rtol=0)  # broadcast to every token
    assert torch.equal(adv, ret)


def test_grpo_without_std_is_dr_grpo():
    # rewards 3, 1 -> mean 2 -> A = +1, -1 (no division)
    adv, _ = grpo(AdvantageInput(outcome([3, 1]), torch.ones(2, 2), torch.tensor([7, 7])), cfg(norm_adv_by_std=False))
    assert adv[:, 0].tolist() == [1.0, -1.0]


def test_grpo_edge_cases():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    # row 0: group of one -> 0; rows 1,2: equal rewards -> 0 / (0 + eps) = 0; row 3 fully masked -> 0
    adv, _ = grpo(AdvantageInput(outcome([5, 1, 1, 2]), mask, torch.tensor([0, 1, 1, 2])), cfg())
    assert torch.count_nonzero(adv) == 0


def test_rloo():
    # group rewards 1, 0, 0: baselines (0+0)/2=0, (1+0)/2=0.5, 0.5 -> A = 1, -0.5, -0.5
    adv, _ = rloo(AdvantageInput(outcome([1, 0, 0]), torch.ones(3, 2), torch.tensor([0, 0, 0])), cfg())
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -0.5, -0.5]))
    # a group of one has no baseline
    adv, _ = rloo(AdvantageInput(outcome([1]), torch.ones(1, 2), torch.tensor([0])), cfg())
    assert adv.abs().sum() == 0


def test_discounted_returns():
    # rewards [1, 0, 2], gamma 0.5: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5
    r = torch.tensor([[1.0, 0.0, 2.0]])
    torch.testing.assert_close(discounted_returns(r, torch.ones(1, 3), 0.5), torch.tensor([[1.5, 1.0, 2.0]]))


def test_reinforce_plus_plus_whitens_over_valid_tokens():
    # returns (gamma 1): row0 [1, 1], row1 [0, pad]: valid values 1, 1, 0 -> mean 2/3,
    # biased std sqrt((1/9 + 1/9 + 4/9) / 3) = sqrt(2/9) = 0.47140
    # A = (1 - 2/3) / 0.4714 = 0.70711 ; (0 - 2/3) / 0.4714 = -1.41421 ; padding 0
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv, ret = reinforce_plus_plus(AdvantageInput(r, mask, torch.tensor([0, 1])), cfg())
    torch.testing.assert_close(adv, torch.tensor([[0.70711, 0.70711], [-1.41421, 0.0]]), atol=1e-4, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


def test_ppo_clip_by_hand():
    # ratios e^0.5 = 1.6487 (A=+1): clipped to 1.2 -> loss -1.2 (clipped)
    #        e^-0.5 = 0.6065 (A=+1): min(0.6065, 0.8) -> -0.6065 (not clipped)
    #        e^0.5 (A=-1): min(-1.6487, -1.2) = -1.6487 -> loss 1.6487 (not clipped)
    #        e^-0.5 (A=-1): min(-0.6065, -0.8) = -0.8 -> loss 0.8 (clipped)
    lp = torch.tensor([[0.5, -0.5, 0.5, -0.5]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, metrics = ppo_clip(PolicyLossInput(lp, torch.zeros(1, 4), adv, torch.ones(1, 4)), cfg())
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -math.exp(-0.5), math.exp(0.5), 0.8]]))
    assert metrics["clip_frac"] == pytest.approx(0.5)


def test_ppo_clip_higher_is_asymmetric():
    # clip_high 0.28: ratio e^0.5 with A=+1 is clipped at 1.28 instead of 1.2
    loss, _ = ppo_clip(PolicyLossInput(torch.tensor([[0.5]]), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)),
                       cfg(clip_ratio_high=0.28))
    assert float(loss) == pytest.approx(-1.28)


def test_vanilla_pg():
    loss, _ = vanilla_pg(PolicyLossInput(torch.tensor([[-2.0]]), None, torch.tensor([[3.0]]), None), cfg())
    assert float(loss) == 6.0  # -A * logp = -3 * -2


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # delta = log p - log q = log 2 = 0.69315
    assert float(k1(lp, ref)) == pytest.approx(0.693147, abs=1e-6)
    assert float(k2(lp, ref)) == pytest.approx(0.5 * 0.693147**2, abs=1e-6)  # 0.240227
    # k3: exp(log q - log p) - (log q - log p) - 1 = 0.5 + 0.693147 - 1 = 0.193147
    assert float(k3(lp, ref)) == pytest.approx(0.193147, abs=1e-6)
    assert float(k3(lp, lp)) == 0.0


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (1 + 2 + 3 + 4) / 4),                # 2.5
    ("seq-mean-token-sum", (6 + 4) / 2),                # 5.0
    ("seq-mean-token-mean", (6 / 3 + 4 / 1) / 2),       # 3.0
    ("seq-mean-token-sum-norm", (6 + 4) / (2 * 3)),     # 1.6667
])
def test_aggregation_modes(mode, expected):
    assert float(aggregate(LOSS, MASK, mode)) == pytest.approx(expected)


def test_aggregation_with_zero_valid_tokens_is_zero_not_nan():
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert float(aggregate(LOSS, torch.zeros_like(MASK), mode)) == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_accumulation_invariance(mode):
    """1x8 and 8x1 micro-batches give the same loss and gradient with global denominators."""
    torch.manual_seed(0)
    w = torch.randn(5, requires_grad=True)
    x = torch.randn(8, 6, 5)
    mask = (torch.rand(8, 6) > 0.3).float()
    mask[2] = 0  # a fully masked row
    adv = torch.randn(8, 6)

    def loss_of(rows):
        logp = torch.log_softmax(x[rows] @ w, -1)
        return -adv[rows] * logp

    tokens, seqs = float(mask.sum()), 8.0
    full = aggregate(loss_of(slice(None)), mask, mode, global_tokens=tokens, global_seqs=seqs)
    (g_full,) = torch.autograd.grad(full, w)
    total, g_acc = 0.0, torch.zeros(5)
    for i in range(8):
        part = aggregate(loss_of(slice(i, i + 1)), mask[i : i + 1], mode, global_tokens=tokens,
                         global_seqs=seqs, max_response_length=6)
        (g,) = torch.autograd.grad(part, w)
        total, g_acc = total + part.item(), g_acc + g
    assert total == pytest.approx(full.item(), rel=1e-5)
    torch.testing.assert_close(g_acc, g_full, rtol=1e-5, atol=1e-6)
