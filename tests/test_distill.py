"""Distillation objectives against numbers computed by hand on a 3-token vocabulary.

Teacher p = [0.7, 0.2, 0.1], student q = [0.4, 0.4, 0.2] (and q2 = [0.6, 0.1, 0.3] for AKL)."""

import math

import pytest
import torch

from roll_core.algorithms.distill import (adaptive_kl, forward_kl, jsd, kd_log_probs, reverse_kl, skewed_forward_kl,
                                          skewed_reverse_kl)

P = torch.tensor([[[0.7, 0.2, 0.1]]]).log()  # [B=1, R=1, V=3]
Q = torch.tensor([[[0.4, 0.4, 0.2]]]).log()
Q2 = torch.tensor([[[0.6, 0.1, 0.3]]]).log()
ln = math.log


def _value(loss: torch.Tensor) -> float:
    assert loss.shape == (1, 1)
    return float(loss.detach())


def test_forward_kl_is_kl_teacher_student():
    # 0.7 ln(0.7/0.4) + 0.2 ln(0.2/0.4) + 0.1 ln(0.1/0.2)
    expected = 0.7 * ln(1.75) + 0.3 * ln(0.5)
    assert _value(forward_kl(Q, P)) == pytest.approx(expected) == pytest.approx(0.1837869, abs=1e-7)


def test_reverse_kl_is_kl_student_teacher():
    # 0.4 ln(0.4/0.7) + 0.4 ln(0.4/0.2) + 0.2 ln(0.2/0.1)
    assert _value(reverse_kl(Q, P)) == pytest.approx(0.4 * ln(0.4 / 0.7) + 0.6 * ln(2)) == pytest.approx(0.1920420,
                                                                                                          abs=1e-7)


def test_skewed_kls_mix_the_other_distribution_in():
    # alpha 0.5: m = 0.5 p + 0.5 q = [0.55, 0.3, 0.15]
    forward = 0.7 * ln(0.7 / 0.55) + 0.2 * ln(0.2 / 0.3) + 0.1 * ln(0.1 / 0.15)
    backward = 0.4 * ln(0.4 / 0.55) + 0.4 * ln(0.4 / 0.3) + 0.2 * ln(0.2 / 0.15)
    assert _value(skewed_forward_kl(Q, P, alpha=0.5)) == pytest.approx(forward) == pytest.approx(0.0471740, abs=1e-7)
    assert _value(skewed_reverse_kl(Q, P, alpha=0.5)) == pytest.approx(backward) == pytest.approx(0.0452277, abs=1e-7)
    # alpha 0.1: m = 0.1 p + 0.9 q = [0.43, 0.38, 0.19] for the forward one
    assert _value(skewed_forward_kl(Q, P, alpha=0.1)) == pytest.approx(
        0.7 * ln(0.7 / 0.43) + 0.2 * ln(0.2 / 0.38) + 0.1 * ln(0.1 / 0.19))
    # alpha 0 is the plain divergence
    assert _value(skewed_forward_kl(Q, P, alpha=0.0)) == pytest.approx(_value(forward_kl(Q, P)))
    assert _value(skewed_reverse_kl(Q, P, alpha=0.0)) == pytest.approx(_value(reverse_kl(Q, P)))


def test_jsd_weighs_both_sides_against_their_mixture():
    # beta 0.5: both against m = [0.55, 0.3, 0.15], half each
    assert _value(jsd(Q, P)) == pytest.approx(0.5 * 0.0471740 + 0.5 * 0.0452277, abs=1e-7)
    # beta 0.25: m = 0.25 p + 0.75 q = [0.475, 0.35, 0.175]
    m = [0.475, 0.35, 0.175]
    expected = (0.25 * sum(a * ln(a / b) for a, b in zip([0.7, 0.2, 0.1], m))
                + 0.75 * sum(a * ln(a / b) for a, b in zip([0.4, 0.4, 0.2], m)))
    assert _value(jsd(Q, P, beta=0.25)) == pytest.approx(expected)
    assert _value(jsd(P, P)) == pytest.approx(0.0, abs=1e-7)


def test_adaptive_kl_weighs_forward_by_the_head_gap_and_reverse_by_the_tail_gap():
    # head (mu 0.5): token 0 only (the mass before it is 0, before token 1 it is 0.7)
    # |p - q2| = [0.1, 0.1, 0.2]: g_head 0.1, g_tail 0.3, so 0.25 FKL + 0.75 RKL
    fkl = 0.7 * ln(0.7 / 0.6) + 0.2 * ln(0.2 / 0.1) + 0.1 * ln(0.1 / 0.3)
    rkl = 0.6 * ln(0.6 / 0.7) + 0.1 * ln(0.1 / 0.2) + 0.3 * ln(0.3 / 0.1)
    assert _value(adaptive_kl(Q2, P)) == pytest.approx(0.25 * fkl + 0.75 * rkl) == pytest.approx(0.1600024, abs=1e-7)
    # mu 0.8: tokens 0 and 1 (0.7 before token 1 is below 0.8): g_head 0.2, g_tail 0.2
    assert _value(adaptive_kl(Q2, P, head_mass=0.8)) == pytest.approx(0.5 * fkl + 0.5 * rkl)
    assert _value(adaptive_kl(P, P)) == 0.0


def test_top_k_with_temperature_keeps_the_rest_of_the_mass_in_a_tail():
    teacher = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])
    student = torch.tensor([[[0.0, 1.0, 2.0, 3.0]]], requires_grad=True)
    s, t = kd_log_probs(student, teacher, temperature=2.0, top_k=2)
    # logits / 2: teacher [1, 0.5, 0, -0.5], student [0, 0.5, 1, 1.5]; support: tokens 0, 1 and the tail
    zt, zs = sum(math.exp(x) for x in (1, 0.5, 0, -0.5)), sum(math.exp(x) for x in (0, 0.5, 1, 1.5))
    p = [math.exp(1) / zt, math.exp(0.5) / zt, (1 + math.exp(-0.5)) / zt]
    q = [1 / zs, math.exp(0.5) / zs, (math.exp(1) + math.exp(1.5)) / zs]
    torch.testing.assert_close(t.exp(), torch.tensor([[p]]))
    torch.testing.assert_close(s.exp(), torch.tensor([[q]]))
    loss = forward_kl(s, t)
    # the ratios p/q are e^1.5, e^0.5 and e^-1 (the two normalisers' ratio cancels in each)
    assert _value(loss) == pytest.approx(1.5 * p[0] + 0.5 * p[1] - 1.0 * p[2]) == pytest.approx(0.551642, abs=1e-6)
    loss.sum().backward()
    assert student.grad[0, 0, 0] < 0  # raise token 0 toward the teacher
    assert (student.grad[0, 0, 2:] > 0).all()  # and push mass off the tokens outside the teacher's top-k


def test_without_top_k_the_support_is_the_whole_vocabulary():
    teacher, student = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    s, t = kd_log_probs(student, teacher, temperature=1.5)
    torch.testing.assert_close(s, (student / 1.5).log_softmax(-1))
    torch.testing.assert_close(t, (teacher / 1.5).log_softmax(-1))
    expected = torch.nn.functional.kl_div(s, t, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(forward_kl(s, t), expected)


def test_the_documented_defaults():
    """alpha 0.1 for the skewed KLs (DistiLLM), beta 0.5 for JSD, head mass 0.5 for AKL, temperature 1."""
    assert _value(skewed_forward_kl(Q, P)) == pytest.approx(_value(skewed_forward_kl(Q, P, alpha=0.1)))
    assert _value(skewed_reverse_kl(Q, P)) == pytest.approx(_value(skewed_reverse_kl(Q, P, alpha=0.1)))
    assert _value(skewed_forward_kl(Q, P)) != pytest.approx(_value(skewed_forward_kl(Q, P, alpha=0.3)))
    assert _value(jsd(Q, P)) == pytest.approx(_value(jsd(Q, P, beta=0.5)))
    assert _value(adaptive_kl(Q, P)) == pytest.approx(_value(adaptive_kl(Q, P, head_mass=0.5)))
    logits = torch.tensor([[[2.0, 0.5, -1.0]]])
    default, explicit = kd_log_probs(logits, logits * 2), kd_log_probs(logits, logits * 2, temperature=1.0)
    torch.testing.assert_close(default[0], explicit[0])
    torch.testing.assert_close(default[0], torch.log_softmax(logits, -1))
