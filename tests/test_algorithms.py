"""Algorithms against numbers computed by hand (the arithmetic is in the comments)."""

import math
from types import SimpleNamespace

import pytest
import torch

from roll_core.algorithms.advantages import (
    AdvantageInput, agentic_reinforce, discounted_returns, gae, gigpo, grpo, masked_whiten, opd, raft, reinforce,
    reinforce_plus_plus, reinforce_plus_plus_baseline, rloo, step_reinforce,
)
from roll_core.algorithms.kl import K3_BOUND, abs_kl, full, k1, k2, k3
from roll_core.algorithms.losses import (
    PolicyLossInput, aggregate, cispo, dual_clip, gspo, kimi, ppo_clip, tis, topr, value_loss, vanilla_pg,
)

EPS = 1e-6


def cfg(**kw):
    base = dict(norm_adv_by_std=True, gamma=1.0, lam=1.0, clip_ratio_low=0.2, clip_ratio_high=0.2,
                dual_clip_c=3.0, tis_cap=2.0, topr_positive_weight=1.0, topr_negative_weight=1.0,
                kimi_tau=0.1, raft_threshold=0.0, gigpo_step_weight=1.0)
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
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    # row 0: group of one -> 0; rows 1,2: equal rewards -> 0 / (0 + eps) = 0; row 3 fully masked -> 0
    adv, _ = grpo(AdvantageInput(outcome([5, 1, 1, 2]), mask, torch.tensor([0, 1, 1, 2])), cfg())
    assert torch.count_nonzero(adv) == 0


def test_outcome_estimators_ignore_rewards_on_masked_tokens():
    # a reward sitting on a padding token is not part of the response: both rows score 0 -> A = 0
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    adv, _ = grpo(AdvantageInput(outcome([5, 0]), mask, torch.tensor([0, 0])), cfg())
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


def test_discounted_returns_skip_masked_tokens_in_the_middle():
    # mask [1, 0, 1], reward 1 on the last token, gamma 1: the masked token (an environment
    # observation) is skipped, so token 0 still gets the return 1, as gae gives it
    r = torch.tensor([[0.0, 5.0, 1.0]])  # a reward on a masked token is ignored
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    torch.testing.assert_close(discounted_returns(r, mask, 1.0), torch.tensor([[1.0, 0.0, 1.0]]))
    # gamma 0.5 over valid tokens only: G2 = 1, G0 = 0 + 0.5 * 1 = 0.5 (one valid step, not two)
    torch.testing.assert_close(discounted_returns(r, mask, 0.5), torch.tensor([[0.5, 0.0, 1.0]]))
    adv, _ = gae(AdvantageInput(r, mask, torch.tensor([0]), values=torch.zeros(1, 3)), cfg(gamma=1.0, lam=1.0))
    torch.testing.assert_close(adv, discounted_returns(r, mask, 1.0))  # the two agree
    adv, _ = reinforce(AdvantageInput(r, mask, torch.tensor([0])), cfg(gamma=1.0))
    assert adv[0, 0] == 1.0


def test_reinforce_plus_plus_whitens_over_valid_tokens():
    # returns (gamma 1): row0 [1, 1], row1 [0, pad]: valid values 1, 1, 0 -> mean 2/3,
    # unbiased var (1/9 + 1/9 + 4/9) / 2 = 1/3, std 0.577350
    # A = (1 - 2/3) / 0.57735 = 0.57735 ; (0 - 2/3) / 0.57735 = -1.15470 ; padding 0
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv, ret = reinforce_plus_plus(AdvantageInput(r, mask, torch.tensor([0, 1])), cfg())
    torch.testing.assert_close(adv, torch.tensor([[0.57735, 0.57735], [-1.15470, 0.0]]), atol=1e-4, rtol=0)
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


# ------------------------------------------------------------------------------------------------
# more advantage estimators
# ------------------------------------------------------------------------------------------------
def test_reinforce_is_the_discounted_return():
    # rewards [0, 1], gamma 0.5: G1 = 1, G0 = 0 + 0.5 * 1 = 0.5 ; padding row stays 0
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    adv, ret = reinforce(AdvantageInput(r, mask, torch.tensor([0, 0])), cfg(gamma=0.5))
    torch.testing.assert_close(adv, torch.tensor([[0.5, 1.0], [0.0, 0.0]]))
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_baseline():
    # group 0 scores 1, 0 -> centred +0.5, -0.5 ; group 1 scores 1, 1 -> 0, 0
    # 8 valid tokens: 0.5, 0.5, -0.5, -0.5, 0, 0, 0, 0 -> mean 0, unbiased var 4 * 0.25 / 7 = 0.142857,
    # std 0.377964 -> A = +-0.5 / 0.377964 = +-1.322876 (and 0)
    adv, centred = reinforce_plus_plus_baseline(
        AdvantageInput(outcome([1, 0, 1, 1]), torch.ones(4, 2), torch.tensor([0, 0, 1, 1])), cfg())
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.322876, -1.322876, 0.0, 0.0]), atol=1e-4, rtol=0)
    torch.testing.assert_close(centred[:, 1], torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_raft_accepts_samples_above_the_threshold():
    batch = AdvantageInput(outcome([1.0, 0.0, 0.5]), torch.ones(3, 2), torch.tensor([0, 0, 0]))
    assert raft(batch, cfg())[0][:, 0].tolist() == [1.0, 0.0, 1.0]  # threshold 0
    assert raft(batch, cfg(raft_threshold=0.6))[0][:, 0].tolist() == [1.0, 0.0, 0.0]


def test_gae_gamma_lambda_one_is_return_minus_value():
    # rewards [0, 0, 1], values [.5, .6, .7], gamma = lam = 1
    # delta2 = 1 + 0 - .7 = .3 ; delta1 = 0 + .7 - .6 = .1 ; delta0 = 0 + .6 - .5 = .1
    # A2 = .3 ; A1 = .1 + .3 = .4 ; A0 = .1 + .4 = .5 ; returns = A + V = 1, 1, 1
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae(AdvantageInput(torch.tensor([[0.0, 0.0, 1.0]]), torch.ones(1, 3), torch.tensor([0]),
                                  values=values), cfg())
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))


def test_gae_discounted():
    # gamma .9, lam .5 (gamma * lam = .45), same rewards and values
    # delta2 = 1 - .7 = .3 ; delta1 = .9 * .7 - .6 = .03 ; delta0 = .9 * .6 - .5 = .04
    # A2 = .3 ; A1 = .03 + .45 * .3 = .165 ; A0 = .04 + .45 * .165 = .11425
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, _ = gae(AdvantageInput(torch.tensor([[0.0, 0.0, 1.0]]), torch.ones(1, 3), torch.tensor([0]),
                                values=values), cfg(gamma=0.9, lam=0.5))
    torch.testing.assert_close(adv, torch.tensor([[0.11425, 0.165, 0.3]]))


def test_gae_padding_ends_the_episode_and_masked_tokens_are_skipped():
    # row 0: mask [1, 1, 0]: the value 9 on padding is never used.
    #   delta1 = 1 + 0 - .4 = .6 ; delta0 = 0 + .4 - .2 = .2 -> A = [.8, .6, 0]
    # row 1: mask [1, 0, 1] (an environment token in the middle): token 0's successor is token 2.
    #   delta2 = 1 - .7 = .3 ; delta0 = 0 + .7 - .5 = .2 -> A0 = .2 + .3 = .5 -> A = [.5, 0, .3]
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 9.0], [0.5, 9.0, 0.7]])
    adv, _ = gae(AdvantageInput(rewards, mask, torch.tensor([0, 1]), values=values), cfg())
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.6, 0.0], [0.5, 0.0, 0.3]]))


def test_gae_without_values_names_the_critic():
    with pytest.raises(ValueError, match="roles.critic"):
        gae(AdvantageInput(outcome([1]), torch.ones(1, 2), torch.tensor([0])), cfg())


# two rows of 4 tokens; row 0 has turns 0, 0, 1, 1 with turn rewards 0.5 and 1; row 1 has two
# one-token turns with reward 0 followed by padding
TURN_REWARDS = torch.tensor([[0.0, 0.5, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
TURN_MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
TURN_INDEX = torch.tensor([[0, 0, 1, 1], [0, 1, -1, -1]])


def test_step_reinforce_whitens_turn_returns():
    # gamma 1: row 0 G = [0.5 + 1, 1] = [1.5, 1]; row 1 G = [0, 0]
    # over the 4 valid turns: mean 2.5 / 4 = 0.625 ; unbiased var (0.875^2 + 0.375^2 + 2 * 0.625^2) / 3
    #   = (0.765625 + 0.140625 + 0.78125) / 3 = 0.5625 ; std 0.75
    # A = 0.875 / 0.75 = 1.166667 ; 0.375 / 0.75 = 0.5 ; -0.625 / 0.75 = -0.833333
    adv, ret = step_reinforce(AdvantageInput(TURN_REWARDS, TURN_MASK, torch.tensor([0, 0]),
                                             turn_index=TURN_INDEX), cfg())
    expected = torch.tensor([[1.166667, 1.166667, 0.5, 0.5], [-0.833333, -0.833333, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.5, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))


def test_agentic_reinforce_uses_the_group_mean_episode_return():
    # same group; episode returns G_0: 1.5 and 0 -> baseline 0.75
    # row 0: [1.5 - .75, 1 - .75] = [.75, .25] ; row 1: [-.75, -.75]
    adv, _ = agentic_reinforce(AdvantageInput(TURN_REWARDS, TURN_MASK, torch.tensor([0, 0]),
                                              turn_index=TURN_INDEX), cfg())
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75, 0.25, 0.25], [-0.75, -0.75, 0.0, 0.0]]))


def test_single_turn_agentic_reinforce_is_dr_grpo():
    batch = AdvantageInput(outcome([1, 0, 0, 1, 1]), torch.ones(5, 2), torch.tensor([0, 0, 0, 1, 1]))
    torch.testing.assert_close(agentic_reinforce(batch, cfg())[0], grpo(batch, cfg(norm_adv_by_std=False))[0])


def test_gigpo_episode_plus_step_groups():
    # group 0: three trajectories of two one-token turns; states (hash) and turn rewards:
    #   T0: states [7, 11], rewards [0, 1] ; T1: [7, 13], [0, 0] ; T2: [7, 11], [1, 0]
    # group 1: T3: states [7, 11], rewards [1, 1] (alone in its group)
    # episode: R = 1, 0, 1 -> mean 2/3 -> A_E = 1/3, -2/3, 1/3 ; T3 alone -> 0   (no std division)
    # turn returns (gamma 1): T0 [1, 1], T1 [0, 0], T2 [1, 0]
    # step groups: (g0, 7): 1, 0, 1 -> A_S = 1/3, -2/3, 1/3 ; (g0, 11): T0 1, T2 0 -> +0.5, -0.5 ;
    #   (g0, 13): T1 alone -> 0 ; (g1, 7), (g1, 11): T3 alone -> 0   (same state, other group)
    # A = A_E + A_S: T0 [2/3, 1/3 + .5] ; T1 [-4/3, -2/3] ; T2 [2/3, 1/3 - .5] ; T3 [0, 0]
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    states = torch.tensor([[7, 11], [7, 13], [7, 11], [7, 11]])
    batch = AdvantageInput(rewards, torch.ones(4, 2), torch.tensor([0, 0, 0, 1]),
                           turn_index=torch.tensor([[0, 1]] * 4), state_hash=states)
    adv, _ = gigpo(batch, cfg(norm_adv_by_std=False))
    expected = torch.tensor([[2 / 3, 5 / 6], [-4 / 3, -2 / 3], [2 / 3, -1 / 6], [0.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    # the step weight scales only the step part: T1 turn 1 has A_S = 0, so it keeps A_E = -2/3
    adv_half, _ = gigpo(batch, cfg(norm_adv_by_std=False, gigpo_step_weight=0.5))
    assert float(adv_half[1, 1]) == pytest.approx(-2 / 3) and float(adv_half[0, 1]) == pytest.approx(1 / 3 + 0.25)


def test_opd_is_teacher_minus_student_log_prob():
    # A = log p_teacher - log p_student: (-1) - (-1.5) = 0.5 ; (-2) - (-1) = -1 ; padding 0
    batch = AdvantageInput(torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([0]),
                           old_log_probs=torch.tensor([[-1.5, -1.0, -3.0]]),
                           teacher_log_probs=torch.tensor([[-1.0, -2.0, -1.0]]))
    torch.testing.assert_close(opd(batch, cfg())[0], torch.tensor([[0.5, -1.0, 0.0]]))


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                  "raft", "step_reinforce", "agentic_reinforce", "gigpo"])
def test_critic_free_estimators_edge_cases(name):
    from roll_core.algorithms import advantages

    fn = getattr(advantages, name)
    # a group of one, an all-equal group and a fully masked row: finite, and 0 on masked tokens
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    adv, ret = fn(AdvantageInput(outcome([1, 0.5, 0.5, 1]), mask, torch.tensor([0, 1, 1, 2])), cfg())
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert adv[3].abs().sum() == 0 and ret[3].abs().sum() == 0
    if name in ("grpo", "rloo", "agentic_reinforce", "gigpo"):  # group baselines: all zero here
        assert adv.abs().sum() == 0
    # zero valid tokens anywhere
    adv, _ = fn(AdvantageInput(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0, 0])), cfg())
    assert adv.abs().sum() == 0


# ------------------------------------------------------------------------------------------------
# more policy losses
# ------------------------------------------------------------------------------------------------
def loss_input(lp, adv, old=None, infer=None):
    lp, adv = torch.tensor([lp]), torch.tensor([adv])
    old = torch.zeros_like(lp) if old is None else torch.tensor([old])
    return PolicyLossInput(lp, old, adv, torch.ones_like(lp), None if infer is None else torch.tensor([infer]))


def test_dual_clip_caps_negative_advantage_losses():
    # ratio e^2 = 7.389 with A = -1: PPO loss = -min(-7.389, -1.2) = 7.389 ; capped at c * |A| = 3
    # ratio e^2 with A = +1: PPO clips to 1.2 -> -1.2 (the cap only applies to A < 0)
    # ratio e^0.1 = 1.10517 (inside the clip range) with A = -1: PPO loss 1.10517, below the cap
    loss, metrics = dual_clip(loss_input([2.0, 2.0, 0.1], [-1.0, 1.0, -1.0]), cfg())
    torch.testing.assert_close(loss, torch.tensor([[3.0, -1.2, math.exp(0.1)]]))
    assert metrics["dual_clip_frac"] == pytest.approx(1 / 3)


def test_gspo_uses_the_sequence_ratio_with_per_token_gradients():
    # log ratios [0.1, 0.3] -> mean 0.2 -> s = e^0.2 = 1.221403 for both tokens
    # A = +1, clip (0.2, 0.2): min(1.2214, 1.2) -> loss -1.2 on both tokens (clipped)
    # with a wide clip range the loss is -s and d(-s)/d lp_t = -s (each token carries the full s)
    lp = torch.tensor([[0.1, 0.3]], requires_grad=True)
    inputs = PolicyLossInput(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    loss, _ = gspo(inputs, cfg())
    torch.testing.assert_close(loss.detach(), torch.tensor([[-1.2, -1.2]]))
    loss, _ = gspo(inputs, cfg(clip_ratio_low=10.0, clip_ratio_high=10.0))
    torch.testing.assert_close(loss.detach(), torch.full((1, 2), -math.exp(0.2)))
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    torch.testing.assert_close(grad, torch.full((1, 2), -math.exp(0.2)))


def test_gspo_ignores_padding_in_the_sequence_ratio():
    # padding token with a huge log-ratio must not move s: mean over the valid token only -> e^0.1
    inputs = PolicyLossInput(torch.tensor([[0.1, 5.0]]), torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[1.0, 0.0]]))
    loss, _ = gspo(inputs, cfg(clip_ratio_low=10.0, clip_ratio_high=10.0))
    assert float(loss[0, 0]) == pytest.approx(-math.exp(0.1), rel=1e-6)


def test_tis_weights_ppo_by_the_truncated_sampler_ratio():
    # old - infer = log 1.5 -> w = 1.5 ; old - infer = log 4 -> w = min(4, cap 2) = 2
    # PPO part: ratio 1 (lp = old = 0), A = 1 -> -1 ; so loss = -1.5 and -2
    loss, metrics = tis(loss_input([0.0, 0.0], [1.0, 1.0], infer=[-math.log(1.5), -math.log(4.0)]), cfg())
    torch.testing.assert_close(loss, torch.tensor([[-1.5, -2.0]]))
    assert metrics["tis_weight_mean"] == pytest.approx(1.75)
    with pytest.raises(ValueError, match="infer_log_probs"):
        tis(loss_input([0.0], [1.0]), cfg())


def test_topr_tapers_only_negative_samples():
    # token 0: A = +2, log p = -1, ratio e^1 -> w = positive weight 1 (no ratio) -> -1 * 2 * -1 = 2
    # token 1: A = -1, log p = 0.5, old 1.0 -> ratio e^-0.5 = 0.60653 -> w = 0.60653
    #   loss = -0.60653 * -1 * 0.5 = 0.30327
    # token 2: A = -1, ratio e^0.5 > 1 -> clipped to 1 -> loss = -1 * -1 * 0.5 = 0.5
    loss, _ = topr(loss_input([-1.0, 0.5, 0.5], [2.0, -1.0, -1.0], old=[-2.0, 1.0, 0.0]), cfg())
    torch.testing.assert_close(loss, torch.tensor([[2.0, 0.5 * math.exp(-0.5), 0.5]]))
    # separate weights: positive 0.5, negative 2 -> 1.0, 0.60653, 1.0
    loss, _ = topr(loss_input([-1.0, 0.5, 0.5], [2.0, -1.0, -1.0], old=[-2.0, 1.0, 0.0]),
                   cfg(topr_positive_weight=0.5, topr_negative_weight=2.0))
    torch.testing.assert_close(loss, torch.tensor([[1.0, math.exp(-0.5), 1.0]]))


def test_cispo_clips_the_detached_weight_and_keeps_every_gradient():
    # ratio e^0.5 = 1.6487, clip high 0.28 -> w = 1.28 ; A = 1 ; loss = -1.28 * 1 * 0.5 = -0.64
    # d loss / d lp = -w * A = -1.28 even though the ratio is outside the clip range (PPO gives 0)
    lp = torch.tensor([[0.5]], requires_grad=True)
    loss, metrics = cispo(PolicyLossInput(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)),
                          cfg(clip_ratio_high=0.28))
    assert float(loss.detach()) == pytest.approx(-0.64)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert float(grad) == pytest.approx(-1.28) and metrics["clip_frac"] == 1.0


def test_kimi_squared_log_ratio():
    # A = 2, log p = -1, old = -1.5: -2 * -1 + 0.1 / 2 * 0.5^2 = 2 + 0.0125 = 2.0125
    loss, _ = kimi(loss_input([-1.0], [2.0], old=[-1.5]), cfg())
    assert float(loss) == pytest.approx(2.0125)


def test_value_loss_clipped_and_unclipped():
    # V = 1.0, V_old = 0.5, G = 2.0, clip 0.2: V_clip = 0.5 + 0.2 = 0.7
    # unclipped (1 - 2)^2 = 1 ; clipped (0.7 - 2)^2 = 1.69 -> 0.5 * max = 0.845
    v, old, g = torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[2.0]])
    assert float(value_loss(v, old, g, 0.2)) == pytest.approx(0.845)
    assert float(value_loss(v, old, g, None)) == pytest.approx(0.5)


def test_kl_abs_and_full():
    lp, ref = torch.tensor([math.log(0.25)]), torch.tensor([math.log(0.5)])
    assert float(abs_kl(lp, ref)) == pytest.approx(math.log(2))  # |log .25 - log .5|
    # p = (.5, .5), q = (.25, .75): KL = .5 log(.5/.25) + .5 log(.5/.75) = .5 * .693147 + .5 * -.405465
    #   = 0.143841
    p = torch.tensor([[[0.5, 0.5]]]).log()
    q = torch.tensor([[[0.25, 0.75]]]).log()
    assert float(full(p, q)) == pytest.approx(0.143841, abs=1e-6)
    assert float(full(p, p)) == 0.0
    with pytest.raises(ValueError, match=r"\[B, R, V\]"):
        full(lp, ref)


# ------------------------------------------------------------------------------------------------
# numerical safety: whitening and k3 stay finite and bounded, in value and gradient
# ------------------------------------------------------------------------------------------------
def _whiten_rewards(values, mask=None):
    x = torch.tensor([values], dtype=torch.float64, requires_grad=True)
    m = torch.ones_like(x) if mask is None else torch.tensor([mask], dtype=torch.float64)
    out = masked_whiten(x, m, shift_mean=False)
    out.sum().backward()
    return out.detach()[0], x.grad[0]


def test_whitening_all_equal_rewards_leaves_them_as_they_are():
    # four 1.0s: mean 1, var 0 -> (x - 1) / sqrt(0 + 1e-6) + 1 = 1 (the old form gave about 1e6)
    out, grad = _whiten_rewards([1.0, 1.0, 1.0, 1.0])
    torch.testing.assert_close(out, torch.ones(4, dtype=torch.float64))
    # d/dx_i sum(out): the centred part sums to 0 identically, the kept mean gives 4 * 1/4 = 1 each
    torch.testing.assert_close(grad, torch.ones(4, dtype=torch.float64))


def test_whitening_near_equal_rewards_stays_near_the_mean():
    # [1, 1, 1, 1.0001]: mean 1.000025; unbiased var (3 * 2.5e-5^2 + 7.5e-5^2) / 3 = 2.5e-9
    # sqrt(2.5e-9 + 1e-6) = 1.0012492e-3 -> -2.5e-5 / 1.0012492e-3 = -0.0249688 ; 7.5e-5 / ... = 0.0749064
    # plus the mean: 0.9750562 (x3) and 1.0749314 (the old form gave about 22,569)
    out, grad = _whiten_rewards([1.0, 1.0, 1.0, 1.0001])
    torch.testing.assert_close(out, torch.tensor([0.9750562, 0.9750562, 0.9750562, 1.0749314], dtype=torch.float64),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, torch.ones(4, dtype=torch.float64))  # as above: bounded, not 1e6


def test_whitening_fewer_than_two_valid_tokens_changes_nothing():
    out, grad = _whiten_rewards([3.0, 7.0], mask=[0.0, 1.0])
    torch.testing.assert_close(out, torch.tensor([0.0, 7.0], dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([0.0, 1.0], dtype=torch.float64))
    out, _ = _whiten_rewards([3.0], mask=[0.0])
    assert out.tolist() == [0.0]


def test_whitening_uses_the_unbiased_variance():
    # [0, 2]: mean 1, unbiased var ((-1)^2 + 1^2) / 1 = 2 -> (x - 1) / sqrt(2) = -0.707107, 0.707107
    # (the biased var, 1, would give -1, 1)
    out = masked_whiten(torch.tensor([[0.0, 2.0]]), torch.ones(1, 2))
    torch.testing.assert_close(out, torch.tensor([[-0.707107, 0.707107]]), atol=1e-5, rtol=0)


def test_k3_is_bounded_in_value_and_gradient_at_large_log_ratios():
    # log q - log p = 20: exp(20) - 20 - 1 = 4.85e8 unbounded; the bound is 10, with no gradient beyond it
    lp = torch.tensor([-20.0, 0.0, -1000.0, 1000.0], requires_grad=True)
    ref = torch.tensor([0.0, 0.0, 0.0, 0.0])
    kl = k3(lp, ref)
    kl.sum().backward()
    assert K3_BOUND == 10.0
    torch.testing.assert_close(kl.detach(), torch.tensor([10.0, 0.0, 10.0, 10.0]))
    assert torch.isfinite(lp.grad).all() and lp.grad.abs().max() <= K3_BOUND
    # inside the bound, the value and gradient are k3's: delta = 1 -> e - 2 = 0.718282,
    # d/d(log p) = -(e^delta - 1) = -1.718282
    lp = torch.tensor([-1.0], requires_grad=True)
    value = k3(lp, torch.tensor([0.0]))
    value.backward()
    assert float(value.detach()) == pytest.approx(0.718282, abs=1e-6)
    assert float(lp.grad) == pytest.approx(-1.718282, abs=1e-6)


# ------------------------------------------------------------------------------------------------
# mutants that survived the fast tests (issue audit): each case below fails on one of them
# ------------------------------------------------------------------------------------------------
def test_seq_mean_token_sum_norm_divides_by_the_configured_horizon():
    # Dr. GRPO: sum(loss * mask) / (seqs * max_response_length): (6 + 4) / (2 * 5) = 1.0, not / (2 * 3)
    assert float(aggregate(LOSS, MASK, "seq-mean-token-sum-norm", max_response_length=5)) == pytest.approx(1.0)
    # with the mini-batch's sequence count (4 over all micro-batches): 10 / (4 * 5) = 0.5
    assert float(aggregate(LOSS, MASK, "seq-mean-token-sum-norm", global_seqs=4, max_response_length=5)) == \
        pytest.approx(0.5)


def test_assembled_actor_loss_signs_of_entropy_bonus_and_kl_term():
    # ratio 1 (log_prob = old), ppo_clip: pg = -A = [-2, 0] -> token-mean -1.0
    # entropy [0.5, 1.5] -> mean 1.0 ; k1 = log_prob - ref = [-1 + 1.5, -1 + 2] = [0.5, 1.0] -> mean 0.75
    # loss = pg - entropy_coef * H + kl_loss_coef * KL = -1.0 - 0.1 * 1.0 + 0.2 * 0.75 = -0.95
    from roll_core.algorithms.objective import ActorObjective, actor_loss
    from roll_core.config.schema import AlgorithmConfig
    from roll_core.data import Batch

    config = AlgorithmConfig(policy_loss="ppo_clip", entropy_coef=0.1, kl_loss_coef=0.2, kl_estimator="k1",
                             loss_agg_mode="token-mean")
    log_prob = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    micro = Batch({"old_log_probs": torch.tensor([[-1.0, -1.0]]), "advantages": torch.tensor([[2.0, 0.0]]),
                   "response_mask": torch.ones(1, 2), "ref_log_probs": torch.tensor([[-1.5, -2.0]])})
    loss, metrics = actor_loss(log_prob, torch.tensor([[0.5, 1.5]]), micro, ActorObjective.from_config(config),
                               global_tokens=2, global_seqs=1)
    assert float(loss.detach()) == pytest.approx(-0.95)
    assert metrics["train/pg_loss"] == pytest.approx(-1.0) and metrics["train/entropy"] == pytest.approx(1.0)
    assert metrics["train/kl"] == pytest.approx(0.75)
    loss.backward()
    # d/d log_prob: pg -A/2 per token (ratio' = ratio) + KL 0.2 * 1/2 -> [-1 + 0.1, 0 + 0.1]
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-0.9, 0.1]]))


def test_gigpo_default_path_divides_by_the_group_stds():
    # the batch of test_gigpo_episode_plus_step_groups, norm_adv_by_std on (the default):
    # episode R = 1, 0, 1: unbiased std sqrt((1/9 + 4/9 + 1/9) / 2) = 0.577350 -> A_E = 0.577350, -1.154701, 0.577350
    # step (g0, 7): the same values -> A_S = 0.577350, -1.154701, 0.577350
    # step (g0, 11): T0 1, T2 0 -> std sqrt(0.5) = 0.707107 -> +-0.707107
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    states = torch.tensor([[7, 11], [7, 13], [7, 11], [7, 11]])
    batch = AdvantageInput(rewards, torch.ones(4, 2), torch.tensor([0, 0, 0, 1]),
                           turn_index=torch.tensor([[0, 1]] * 4), state_hash=states)
    adv, _ = gigpo(batch, cfg())
    expected = torch.tensor([[1.154701, 0.577350 + 0.707107], [-2.309401, -1.154701],
                             [1.154701, 0.577350 - 0.707107], [0.0, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_step_reinforce_whitens_over_valid_turns_of_rows_with_different_turn_counts():
    # row 0: three turns (tokens 0-1, 2, 3) with rewards 1, 0, 2 ; row 1: one turn (token 0), reward 3
    # returns (gamma 1): row 0 [3, 2, 2], row 1 [3] ; over these 4 turns: mean 2.5,
    # unbiased var (4 * 0.25) / 3 = 1/3, std 0.577350 -> 3 -> 0.866025, 2 -> -0.866025
    r = torch.tensor([[0.0, 1.0, 0.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    turns = torch.tensor([[0, 0, 1, 2], [0, -1, -1, -1]])
    adv, _ = step_reinforce(AdvantageInput(r, mask, torch.tensor([0, 1]), turn_index=turns), cfg())
    expected = torch.tensor([[0.866025, 0.866025, -0.866025, -0.866025], [0.866025, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_topr_weight_carries_no_gradient():
    # A = -1, log_prob -1.5, old -1.0: ratio e^-0.5 = 0.606531, w = sg(clip(ratio, 0, 1)) = 0.606531
    # loss = -w * A * log_prob = -0.909796 ; d/d log_prob = -w * A = 0.606531 (stop-gradient on w;
    # without it the ratio's own derivative would add -A * ratio * log_prob = -0.909796)
    log_prob = torch.tensor([[-1.5]], requires_grad=True)
    inputs = PolicyLossInput(log_prob, torch.tensor([[-1.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1))
    loss, _ = topr(inputs, cfg())
    assert float(loss.detach()) == pytest.approx(-0.909796, abs=1e-6)
    loss.sum().backward()
    assert float(log_prob.grad) == pytest.approx(0.606531, abs=1e-6)


# ------------------------------------------------------------------------------------------------
# mutants that survived mutmut (docs/testing.md): each case below fails on at least one of them
# ------------------------------------------------------------------------------------------------
def test_full_kl_rejects_token_log_probs_and_reduces_over_the_vocabulary_only():
    with pytest.raises(ValueError, match=r"^kl estimator 'full' needs \[B, R, V\] log-distributions, got "):
        full(torch.zeros(2, 3), torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match=r"^kl estimator 'full' needs \[B, R, V\] log-distributions, got "):
        full(torch.zeros(2, 3, 4), torch.zeros(2, 3))
    uniform = torch.full((2, 3, 4), math.log(0.25))
    assert full(uniform, uniform).shape == (2, 3)


def test_turn_layout_marks_padding_minus_one_and_counts_turns():
    from roll_core.algorithms.advantages import turn_layout, turn_rewards

    single = AdvantageInput(torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]), torch.tensor([0]))
    turns, n = turn_layout(single)
    assert turns.tolist() == [[0, -1]] and n == 1
    # padding is -1 whatever turn_index says there
    multi = AdvantageInput(torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([0]),
                           turn_index=torch.tensor([[0, 1, 0]]))
    turns, n = turn_layout(multi)
    assert turns.tolist() == [[0, 1, -1]] and n == 2
    empty = AdvantageInput(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([0]))
    assert turn_layout(empty)[1] == 0
    rewards, valid, _ = turn_rewards(single)
    assert rewards.shape == (1, 1) and valid.tolist() == [[True]]


def test_gae_skips_an_observation_token_in_the_middle():
    # mask [1, 0, 1], rewards [0, 0, 1], V [.5, .9, .25], gamma .5, lam 1:
    # t2: delta = 1 - .25 = .75 -> A2 = .75 ; t1 masked (skipped: t0's successor is t2)
    # t0: delta = 0 + .5 * .25 - .5 = -.375 -> A0 = -.375 + .5 * .75 = 0
    # returns = (A + V) * mask = [.5, 0, 1.0] (0, not NaN, on the masked token)
    batch = AdvantageInput(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[1.0, 0.0, 1.0]]), torch.tensor([0]),
                           values=torch.tensor([[0.5, 0.9, 0.25]]))
    adv, returns = gae(batch, cfg(gamma=0.5, lam=1.0))
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0, 0.75]]))
    torch.testing.assert_close(returns, torch.tensor([[0.5, 0.0, 1.0]]))


def test_rloo_group_of_two():
    # scores 1, 0: n / (n - 1) * (r - mean) = 2 * (+-.5) = +-1 (the other sample is the baseline)
    adv, _ = rloo(AdvantageInput(outcome([1.0, 0.0]), torch.ones(2, 2), torch.tensor([0, 0])), cfg())
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]))


def test_gigpo_step_groups_are_per_episode_group_and_state():
    # one turn each, no std normalisation; (group, state, reward):
    # r0 (0, A, 1) r1 (0, B, 0) r2 (0, B, 1) | r3 (1, A, 0) r4 (1, A, 1) | r5 (2, A, 1) r6 (2, A, 1)
    # episode: group 0 mean 2/3 -> 1/3, -2/3, 1/3 ; group 1 -> -.5, .5 ; group 2 -> 0, 0
    # step groups (group, state): {r0} alone -> 0 ; {r1, r2} -> -.5, .5 ; {r3, r4} -> -.5, .5 ; {r5, r6} -> 0, 0
    # (group 0 state B and group 2 state A are different step groups although both hold "1"s)
    scores = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    batch = AdvantageInput(outcome(scores, width=1), torch.ones(7, 1), torch.tensor([0, 0, 0, 1, 1, 2, 2]),
                           state_hash=torch.tensor([[5], [9], [9], [5], [5], [5], [5]]))
    adv, _ = gigpo(batch, cfg(norm_adv_by_std=False))
    expected = [1 / 3, -2 / 3 - 0.5, 1 / 3 + 0.5, -1.0, 1.0, 0.0, 0.0]
    torch.testing.assert_close(adv[:, 0], torch.tensor(expected), atol=1e-6, rtol=0)


def test_opd_needs_both_teacher_and_old_log_probs():
    mask = torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"^advantage estimator 'opd' needs teacher log-probs \(configure roles.reference\)$"):
        opd(AdvantageInput(torch.zeros(1, 2), mask, torch.tensor([0]), teacher_log_probs=torch.zeros(1, 2)), cfg())
    with pytest.raises(ValueError, match=r"^advantage estimator 'opd' needs teacher log-probs \(configure roles.reference\)$"):
        opd(AdvantageInput(torch.zeros(1, 2), mask, torch.tensor([0]), old_log_probs=torch.zeros(1, 2)), cfg())


LOG_HALF = math.log(0.5)


def _one_row(log_prob, adv, old=None, infer=None):
    lp = torch.tensor([log_prob])
    return PolicyLossInput(lp, torch.zeros_like(lp) if old is None else torch.tensor([old]), torch.tensor([adv]),
                           torch.ones_like(lp), None if infer is None else torch.tensor([infer]))


def test_dual_clip_caps_only_negative_advantages():
    # t0: A -2, ratio 5: -min(-10, 1.2 * -2) = 10, capped at c |A| = 6 ; t1: A .5, ratio 1: -.5 (never capped)
    loss, metrics = dual_clip(_one_row([math.log(5.0), 0.0], [-2.0, 0.5]), cfg())
    torch.testing.assert_close(loss, torch.tensor([[6.0, -0.5]]))
    assert metrics["dual_clip_frac"] == pytest.approx(0.5)


def test_tis_weight_saturates_at_exp_minus_20_and_needs_inference_log_probs():
    # old - infer = -30 is clamped to -20 before exp: w = e^-20 ; ratio 1, A 1: loss = -w
    loss, metrics = tis(_one_row([0.0], [1.0], old=[0.0], infer=[30.0]), cfg())
    assert float(loss[0, 0]) == pytest.approx(-math.exp(-20.0), rel=1e-4)
    assert metrics["tis_weight_mean"] == pytest.approx(math.exp(-20.0), rel=1e-4)
    with pytest.raises(ValueError, match=r"^policy loss 'tis' needs the inference log-probs \('infer_log_probs' in the batch\)$"):
        tis(_one_row([0.0], [1.0]), cfg())


def test_topr_weights_by_the_sign_of_the_advantage():
    # ratio .5 everywhere; A .5 and 0 take the positive weight 1, A -1 takes clip(.5, 0, 1) = .5
    # loss = -w A log_prob = [.5 ln2, 0, -.5 ln2] ; negative_weight_mean = (0 + 0 + .5) / 3
    loss, metrics = topr(_one_row([LOG_HALF] * 3, [0.5, 0.0, -1.0]), cfg())
    ln2 = math.log(2.0)
    torch.testing.assert_close(loss, torch.tensor([[0.5 * ln2, 0.0, -0.5 * ln2]]))
    assert metrics == {"negative_weight_mean": pytest.approx(0.5 / 3)}


def test_cispo_clips_the_weight_from_below_too():
    # ratio .5 -> w = clip(.5, .8, 1.2) = .8 ; loss = -w A log_prob = -.8 * 2 * ln .5 = 1.6 ln2
    loss, metrics = cispo(_one_row([LOG_HALF], [2.0]), cfg())
    assert float(loss[0, 0]) == pytest.approx(1.6 * math.log(2.0))
    assert metrics["approx_kl"] == pytest.approx(math.log(2.0))  # mean(-log ratio)


def test_kimi_loss_value_and_approx_kl():
    # -A log_prob + tau / 2 (log ratio)^2 = 2 ln2 + .05 ln2^2
    loss, metrics = kimi(_one_row([LOG_HALF], [2.0]), cfg())
    ln2 = math.log(2.0)
    assert float(loss[0, 0]) == pytest.approx(2 * ln2 + 0.05 * ln2**2)
    assert metrics["approx_kl"] == pytest.approx(ln2)


# ------------------------------------------------------------------------------------------------
# the loss functions trained roles minimise (algorithms/objective.py)
# ------------------------------------------------------------------------------------------------
def _algo(**kw):
    from roll_core.config.schema import AlgorithmConfig

    return AlgorithmConfig(**kw)


def test_which_passes_need_full_distributions():
    from roll_core.algorithms.objective import distributions_needed

    assert distributions_needed(_algo(kl_estimator="full")) == (False, False)  # no KL loss term
    assert distributions_needed(_algo(kl_estimator="full", kl_loss_coef=0.1)) == (True, False)
    assert distributions_needed(_algo(kl_estimator="k3", kl_loss_coef=0.1)) == (False, False)
    assert distributions_needed(_algo(kl_penalty={"coef": 0.1, "estimator": "full"})) == (False, True)
    assert distributions_needed(_algo(kl_penalty={"coef": 0.0, "estimator": "full"})) == (False, False)
    assert distributions_needed(_algo(kl_penalty={"coef": 0.1, "estimator": "k1"})) == (False, False)


def test_actor_objective_resolves_names_and_reads_the_rollout():
    from roll_core.algorithms.kl import k3
    from roll_core.algorithms.objective import ActorObjective
    from roll_core.config.schema import RolloutConfig

    obj = ActorObjective.from_config(_algo(kl_estimator="full", kl_loss_coef=0.2, entropy_coef=0.01),
                                     RolloutConfig(max_new_tokens=7, temperature=0.5))
    assert (obj.max_response_length, obj.temperature, obj.kl_distribution) == (7, 0.5, True)
    assert (obj.kl_loss_coef, obj.entropy_coef, obj.loss_agg_mode) == (0.2, 0.01, "token-mean")
    assert obj.outputs == {"log_probs", "entropy", "log_dist"} and obj.policy_loss is ppo_clip
    plain = ActorObjective.from_config(_algo())
    assert (plain.max_response_length, plain.temperature, plain.kl_distribution, plain.kl) == (None, 1.0, False, k3)
    assert plain.outputs == {"log_probs", "entropy"}
    assert ActorObjective.from_config(_algo(kl_estimator="full")).outputs == {"log_probs", "entropy"}  # no KL term


def test_actor_objective_call_passes_entropy_and_log_dist():
    from roll_core.algorithms.objective import ActorObjective
    from roll_core.data import Batch

    # entropy [1, 3] -> mean 2 ; full KL of (.5, .5) against (.25, .75) per token: 0.143841
    obj = ActorObjective.from_config(_algo(kl_estimator="full", kl_loss_coef=1.0))
    old = torch.log(torch.tensor([0.5, 0.5])).expand(1, 2, 2)
    ref = torch.log(torch.tensor([0.25, 0.75])).expand(1, 2, 2)
    micro = Batch({"advantages": torch.zeros(1, 2), "response_mask": torch.ones(1, 2),
                   "ref_log_probs": torch.zeros(1, 2), "ref_log_dist": ref})
    _, metrics = obj({"log_probs": torch.zeros(1, 2), "entropy": torch.tensor([[1.0, 3.0]]), "log_dist": old},
                     micro, 2.0, 1.0)
    assert metrics["train/entropy"] == pytest.approx(2.0)
    assert metrics["train/kl"] == pytest.approx(0.5 * math.log(2.0) + 0.5 * math.log(0.5 / 0.75), rel=1e-5)


def test_critic_objective_clips_and_uses_the_configured_horizon():
    from roll_core.algorithms.objective import CriticObjective
    from roll_core.config.schema import RolloutConfig
    from roll_core.data import Batch

    # V 2, V_old 0, G 0, clip .5: unclipped (2 - 0)^2 = 4, clipped (0 + .5 - 0)^2 = .25 -> .5 * max = 2
    # one token of a 1-token response; seq-mean-token-sum-norm divides by seqs * horizon = 1 * 4
    obj = CriticObjective.from_config(_algo(value_clip=0.5, loss_agg_mode="seq-mean-token-sum-norm"),
                                      RolloutConfig(max_new_tokens=4))
    assert (obj.value_clip, obj.max_response_length, obj.outputs) == (0.5, 4, {"values"})
    micro = Batch({"values": torch.zeros(1, 1), "returns": torch.zeros(1, 1), "response_mask": torch.ones(1, 1)})
    loss, metrics = obj({"values": torch.tensor([[2.0]])}, micro, 1.0, 1.0)
    assert float(loss) == pytest.approx(2.0 / 4) and metrics["critic/abs_error"] == pytest.approx(2.0)
    unclipped = CriticObjective.from_config(_algo(value_clip=None))  # no horizon: the response width
    assert unclipped.max_response_length is None
    loss, _ = unclipped({"values": torch.tensor([[2.0]])}, micro, 1.0, 1.0)
    assert float(loss) == pytest.approx(2.0)  # 0.5 * 4, token-mean


def test_supervised_objective_is_token_mean_cross_entropy_over_the_mini_batch():
    from roll_core.algorithms.objective import SupervisedObjective
    from roll_core.data import Batch

    # log-probs [-1, -2, (pad)]: -(-1 - 2) / 4 tokens of the whole mini-batch = 0.75
    obj = SupervisedObjective("sft/loss")
    micro = Batch({"response_mask": torch.tensor([[1, 1, 0]])})
    loss, metrics = obj({"log_probs": torch.tensor([[-1.0, -2.0, -5.0]])}, micro, 4.0, 1.0)
    assert float(loss) == pytest.approx(0.75) and metrics == {"sft/loss": pytest.approx(0.75)}
    assert obj.additive == {"sft/loss"} and obj.outputs == {"log_probs"}


def test_a_loss_registered_with_options_is_called_with_them(roll_plugins):
    from pydantic import BaseModel

    from roll_core.algorithms.objective import ActorObjective
    from roll_core.testing import hooks

    class Opts(BaseModel):
        scale: float = 1.0

    def scaled(inputs, config, options):
        return options.scale * inputs.advantages, {}

    plugins = roll_plugins(("o", hooks(
        roll_register_policy_losses=lambda register: register("scaled", scaled, options=Opts))))
    obj = ActorObjective.from_config(_algo(policy_loss="scaled", policy_loss_options={"scale": 3.0}), plugins=plugins)
    out, _ = obj.policy_loss(PolicyLossInput(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)),
                             None)
    assert float(out) == 3.0


def test_gspo_ratio_is_the_geometric_mean_of_the_token_ratios():
    # log_prob [-1, -3], old [-2, -2]: mean log-ratio (1 - 1) / 2 = 0 -> s = 1 -> loss = -A per token,
    # whereas the sum of the two (a wrong sign) would give mean (-3 - 5) / 2 = -4 -> s = e^-4, clipped to .8
    loss, metrics = gspo(PolicyLossInput(torch.tensor([[-1.0, -3.0]]), torch.tensor([[-2.0, -2.0]]),
                                         torch.tensor([[1.0, 1.0]]), torch.ones(1, 2)), cfg())
    torch.testing.assert_close(loss, torch.tensor([[-1.0, -1.0]]))
    assert metrics["clip_frac"] == 0.0


def test_the_log_ratio_is_clamped_to_plus_minus_20():
    # log_prob - old = +30 with A = -1: -min(r A, clip(r) A) = r = e^20 (not e^30, which would swamp the batch)
    loss, _ = ppo_clip(PolicyLossInput(torch.tensor([[30.0]]), torch.zeros(1, 1), -torch.ones(1, 1),
                                       torch.ones(1, 1)), cfg())
    assert float(loss) == pytest.approx(math.exp(20.0), rel=1e-5)
    # -30 with A = 1: -min(r, .8) = -e^-20
    loss, _ = ppo_clip(PolicyLossInput(torch.tensor([[-30.0]]), torch.zeros(1, 1), torch.ones(1, 1),
                                       torch.ones(1, 1)), cfg())
    assert float(loss) == pytest.approx(-math.exp(-20.0), rel=1e-4)


def test_value_loss_clips_from_below_around_the_old_value():
    # V -1, V_old 1, G -3, clip .5: V_clip = 1 + clip(-2, -.5, .5) = .5
    # unclipped (-1 + 3)^2 = 4, clipped (.5 + 3)^2 = 12.25 -> .5 * max = 6.125
    loss = value_loss(torch.tensor([[-1.0]]), torch.tensor([[1.0]]), torch.tensor([[-3.0]]), 0.5)
    assert float(loss) == pytest.approx(6.125)
    assert float(value_loss(torch.tensor([[-1.0]]), torch.tensor([[1.0]]), torch.tensor([[-3.0]]), None)) == 2.0


def test_gae_without_a_critic_says_what_to_configure():
    with pytest.raises(ValueError, match=r"^advantage estimator 'gae' needs critic values \(configure roles.critic\)$"):
        gae(AdvantageInput(torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([0])), cfg())


def _captured_actor_loss(micro, log_prob, **kw):
    """Run ``actor_loss`` with a policy loss that records what it was given and returns ``-A``."""
    from roll_core.algorithms.objective import ActorObjective, actor_loss

    seen = {}

    def policy_loss(inputs, config):
        seen["inputs"] = inputs
        return -inputs.advantages, {"seen": 1.0}

    fields = dict(policy_loss=policy_loss, config=None, loss_agg_mode="seq-mean-token-sum-norm",
                  max_response_length=None, temperature=1.0)
    objective = ActorObjective(**{**fields, **kw})
    loss, metrics = actor_loss(log_prob, None, micro, objective, global_tokens=2.0, global_seqs=1.0)
    return float(loss.detach()), metrics, seen["inputs"]


def test_actor_loss_hands_the_policy_loss_the_batch_log_probs_and_the_horizon():
    from roll_core.data import Batch

    log_prob = torch.tensor([[-1.0, -2.0, -3.0, -4.0]], dtype=torch.float64)
    old, infer = torch.full((1, 4), -0.5), torch.full((1, 4), -0.7)
    micro = Batch({"advantages": torch.tensor([[2.0, 2.0, 5.0, 5.0]]), "response_mask": torch.ones(1, 4),
                   "loss_mask": torch.tensor([[1.0, 1.0, 0.0, 0.0]]), "old_log_probs": old, "infer_log_probs": infer})
    # Dr. GRPO: sum(-A * mask) / (seqs * horizon) = -4 / (1 * 4): the horizon is the response width ...
    loss, metrics, seen = _captured_actor_loss(micro, log_prob)
    # |log pi - log pi_infer| over the loss tokens: (|-1 + .7| + |-2 + .7|) / 2 = 0.8
    assert loss == pytest.approx(-1.0) and metrics == {"train/seen": 1.0, "train/pg_loss": pytest.approx(-1.0),
                                                       "train/infer_log_prob_gap": pytest.approx(0.8)}
    assert seen.old_log_prob is old and seen.infer_log_probs is infer and seen.log_prob is log_prob
    assert seen.response_mask.tolist() == [[1.0, 1.0, 0.0, 0.0]] and seen.response_mask.dtype == torch.float64
    # ... or the rollout's max_new_tokens when known: -4 / (1 * 8)
    assert _captured_actor_loss(micro, log_prob, max_response_length=8)[0] == pytest.approx(-0.5)
    # without old log-probs (reused from the update) the loss sees its own, detached
    bare = Batch({"advantages": micro["advantages"], "response_mask": torch.ones(1, 4)})
    _, _, seen = _captured_actor_loss(bare, log_prob.clone().requires_grad_())
    assert torch.equal(seen.old_log_prob, seen.log_prob) and not seen.old_log_prob.requires_grad
    assert seen.infer_log_probs is None


def test_actor_loss_reports_kl_only_when_it_can_compute_it():
    from roll_core.algorithms.kl import full, k1
    from roll_core.algorithms.objective import ActorObjective, actor_loss
    from roll_core.data import Batch

    log_prob = torch.zeros(1, 2)
    base = {"advantages": torch.zeros(1, 2), "response_mask": torch.ones(1, 2)}
    with_ref = Batch({**base, "ref_log_probs": torch.full((1, 2), -1.0)})
    # k1 = log_prob - ref = 1 per token; Dr. GRPO over 2 tokens of a 2-wide response: 2 / 2 = 1
    loss, metrics, _ = _captured_actor_loss(with_ref, log_prob, kl=k1, kl_loss_coef=0.5)
    assert metrics["train/kl"] == pytest.approx(1.0) and loss == pytest.approx(0.5)
    assert "train/kl" not in _captured_actor_loss(Batch(base), log_prob, kl=k1, kl_loss_coef=0.5)[1]
    assert "train/kl" not in _captured_actor_loss(with_ref, log_prob, kl=None)[1]
    # a distribution estimator needs both distributions; without them the term is left out, not faked
    p = torch.log(torch.tensor([0.5, 0.5])).expand(1, 2, 2)
    q = torch.log(torch.tensor([0.25, 0.75])).expand(1, 2, 2)
    no_dist = _captured_actor_loss(with_ref, log_prob, kl=full, kl_distribution=True, kl_loss_coef=1.0)
    assert "train/kl" not in no_dist[1] and no_dist[0] == pytest.approx(0.0)
    objective_kw = dict(kl=full, kl_distribution=True, kl_loss_coef=1.0)
    only_ref = Batch({**base, "ref_log_probs": torch.zeros(1, 2), "ref_log_dist": q})
    loss, metrics, _ = _captured_actor_loss(only_ref, log_prob, **objective_kw)  # no log_dist of the actor
    assert "train/kl" not in metrics
    obj = ActorObjective(policy_loss=lambda i, c: (-i.advantages, {}), config=None, loss_agg_mode="token-mean",
                         max_response_length=None, temperature=1.0, **objective_kw)
    loss, metrics = actor_loss(log_prob, None, only_ref, obj, global_tokens=2.0, global_seqs=1.0, log_dist=p)
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert metrics["train/kl"] == pytest.approx(expected, rel=1e-5) and float(loss) == pytest.approx(expected, rel=1e-5)
    missing_ref = Batch({**base, "ref_log_probs": torch.zeros(1, 2)})
    assert "train/kl" not in actor_loss(log_prob, None, missing_ref, obj, global_tokens=2.0, global_seqs=1.0,
                                        log_dist=p)[1]


def test_old_log_probs_are_only_reused_for_a_single_optimizer_step():
    from roll_core.algorithms.objective import old_log_probs_reusable, reuses_update_log_probs, single_mini_batch
    from roll_core.config import load_config

    def reuse(*overrides, batch=256):
        return reuses_update_log_probs(load_config(None, list(overrides)).algorithm, batch)

    assert reuse()  # the default: one epoch, the whole batch as one mini-batch
    assert reuse("algorithm.ppo_mini_batch_size=256")
    assert not reuse("algorithm.ppo_mini_batch_size=128")  # the second mini-batch is off-policy
    assert not reuse("algorithm.ppo_epochs=2")
    assert not reuse("algorithm.kl_penalty.coef=0.1")  # the reward penalty reads them first
    assert not reuse("algorithm.advantage_estimator=opd")  # registered with reads_old_log_probs
    assert not reuse("algorithm.opd_coef=0.5")  # the distillation term reads them beside any estimator
    assert not reuse("algorithm.old_log_probs=recompute")
    # the two halves a pipeline calls separately: the config's part once, the batch size per batch
    algo = load_config(None, ["algorithm.ppo_mini_batch_size=64"]).algorithm
    assert old_log_probs_reusable(algo)
    assert single_mini_batch(algo, 64) and single_mini_batch(algo, 32) and not single_mini_batch(algo, 65)
    assert single_mini_batch(load_config(None, []).algorithm, 10_000)  # no mini-batch size: the whole batch


def test_the_reference_is_read_only_by_kl_terms_distillation_and_what_registers_a_need(roll_plugins):
    from roll_core.algorithms.objective import reference_read
    from roll_core.config import load_config
    from roll_core.testing import hooks

    plugins = roll_plugins(("needy", hooks(roll_register_policy_losses=lambda register: register(
        "needs_ref", lambda *a, **k: None, needs=("reference",)))))

    def read(*overrides):
        return reference_read(load_config(None, list(overrides)).algorithm, plugins)

    assert not read()  # the quickstart: a reference is configured, nothing reads it
    for reader in ("algorithm.kl_loss_coef=0.01", "algorithm.kl_penalty.coef=0.01", "algorithm.opd_coef=0.5",
                   "algorithm.kl_metric=true", "algorithm.advantage_estimator=opd", "algorithm.policy_loss=needs_ref"):
        assert read(reader), reader
