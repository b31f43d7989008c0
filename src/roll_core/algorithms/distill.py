"""Knowledge-distillation objectives: a student's next-token distributions pulled toward a teacher's.

A distillation loss is ``fn(student_logp, teacher_logp, **options) -> loss [B, R]``: per response
token, a divergence between two distributions given as log-probs ``[B, R, K]`` over the same ``K``
outcomes (the vocabulary, or the teacher's top-k tokens and a tail; see :func:`kd_log_probs`). The student's
carry the gradient; the teacher's are constant. The pipeline masks and averages the ``[B, R]``
matrix like any per-token loss. Registered through ``roll_register_distill_losses``.

Notation: ``p`` the teacher's distribution, ``q`` the student's, ``KL(a || b) = sum a (log a - log b)``.
Forward KL is mean-seeking (the student covers every mode of the teacher), reverse KL mode-seeking
(it commits to the teacher's largest mode); the others interpolate.
"""

from __future__ import annotations

import math

import torch


def kd_log_probs(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
                 top_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both models' log-distributions at ``temperature`` over a shared support (Hinton et al. 2015,
    arXiv:1503.02531: logits divided by ``T`` soften both distributions).

    With ``top_k``, the support is the teacher's ``k`` most likely tokens at each position (what a
    teacher role streams instead of its whole vocabulary) plus one *tail* outcome, "any other token",
    holding each model's remaining mass (:func:`with_tail`). Both stay exact distributions, so the
    student is also pushed off the tokens the teacher finds unlikely (renormalising over the top-k
    alone would leave its mass there untouched). Shapes: logits ``[B, R, V]``; returns two
    ``[B, R, K]`` (``K = top_k + 1`` or ``V``). Hinton's ``T^2`` gradient scale is the caller's.
    """
    student = (student_logits / temperature).log_softmax(-1)
    teacher = (teacher_logits / temperature).log_softmax(-1)
    if top_k is None:
        return student, teacher
    teacher, index = teacher.topk(top_k, dim=-1)
    return with_tail(student.gather(-1, index)), with_tail(teacher)


def with_tail(log_probs: torch.Tensor) -> torch.Tensor:
    """Log-probs ``[..., K]`` of ``K`` outcomes of a larger distribution, with the log of the rest's
    total mass appended: ``[..., K + 1]``, a distribution again. The tail is floored at
    ``log(1e-7)``-ish where the ``K`` hold (nearly) all the mass."""
    covered = log_probs.logsumexp(-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([log_probs, torch.log(-torch.expm1(covered))], dim=-1)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """``KL(a || b)`` over the last dimension; terms where ``a = 0`` count 0."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(-1)


def _log_mixture(log_a: torch.Tensor, log_b: torch.Tensor, weight_a: float) -> torch.Tensor:
    """``log(w a + (1 - w) b)``, computed in log space."""
    return torch.logaddexp(log_a + math.log(weight_a), log_b + math.log(1 - weight_a))


def forward_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)``, the classic distillation loss (the teacher's soft labels' cross-entropy minus
    their constant entropy). Shapes: ``[B, R, K]`` in, ``[B, R]`` out."""
    return _kl(teacher_logp, student_logp)


def reverse_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """``KL(q || p)`` (MiniLLM, Gu et al. 2023, arXiv:2306.08543): mode-seeking, so the student
    does not spread mass over what the teacher finds unlikely. Shapes as :func:`forward_kl`."""
    return _kl(student_logp, teacher_logp)


def skewed_forward_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor, alpha: float = 0.1) -> torch.Tensor:
    """Skew KL (DistiLLM, Ko et al. 2024, arXiv:2402.03898): ``KL(p || alpha p + (1 - alpha) q)``.
    Mixing some teacher into the student's side bounds the loss where ``q`` is near 0, which keeps
    its gradients finite. ``alpha`` in ``[0, 1)``; 0 is :func:`forward_kl`. Shapes as :func:`forward_kl`."""
    return _kl(teacher_logp, _log_mixture(teacher_logp, student_logp, alpha) if alpha > 0 else student_logp)


def skewed_reverse_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor, alpha: float = 0.1) -> torch.Tensor:
    """Skew reverse KL (DistiLLM): ``KL(q || alpha q + (1 - alpha) p)``. ``alpha`` in ``[0, 1)``;
    0 is :func:`reverse_kl`. Shapes as :func:`forward_kl`."""
    return _kl(student_logp, _log_mixture(student_logp, teacher_logp, alpha) if alpha > 0 else teacher_logp)


def jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence (GKD, Agarwal et al. 2024, arXiv:2306.13649)::

        m = beta p + (1 - beta) q ;   JSD_beta = beta KL(p || m) + (1 - beta) KL(q || m)

    ``beta = 0.5`` is the symmetric JS divergence, bounded by ``log 2``. ``beta`` in ``(0, 1)``.
    Shapes as :func:`forward_kl`."""
    mixture = _log_mixture(teacher_logp, student_logp, beta)
    return beta * _kl(teacher_logp, mixture) + (1 - beta) * _kl(student_logp, mixture)


def adaptive_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor, head_mass: float = 0.5) -> torch.Tensor:
    """Adaptive KL (AKL, Wu et al. 2024, arXiv:2404.02657): forward KL fits the teacher's head
    (its likely tokens) first, reverse KL its tail; AKL weighs them by where the student is wrong::

        head   = the teacher's most likely tokens, up to and including the one where their
                 cumulative probability reaches head_mass (the paper's mu)
        g_head = sum_head |p - q| ;   g_tail = sum_tail |p - q|     (q detached: weights, not targets)
        AKL    = g_head / (g_head + g_tail) * KL(p || q) + g_tail / (g_head + g_tail) * KL(q || p)

    Where ``q = p`` exactly both gaps are 0 and so is the loss. Shapes as :func:`forward_kl`.
    """
    p, q = teacher_logp.exp(), student_logp.detach().exp()
    sorted_p, order = p.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # teacher mass of the tokens ranked above each one
    head = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, before < head_mass)
    gap = (p - q).abs()
    g_head, g_tail = (gap * head).sum(-1), (gap * ~head).sum(-1)
    total = (g_head + g_tail).clamp(min=1e-12)
    return g_head / total * forward_kl(student_logp, teacher_logp) + g_tail / total * reverse_kl(student_logp,
                                                                                                 teacher_logp)
