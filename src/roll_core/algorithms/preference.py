"""Preference losses: learning from pairs (prompt, chosen response, rejected response).

A preference loss is ``fn(inputs: PreferenceInput, *, beta, label_smoothing) -> (loss [B], metrics)``:
one loss per pair, from the sequence log-probs of both responses under the policy and under a
frozen reference (a reference role, or log-probs computed once and stored with the data). The
pipeline averages it over pairs. Registered through ``roll_register_preference_losses``.

Shared notation, per pair::

    chosen_logratio   = policy_chosen - reference_chosen          (log pi/pi_ref of the chosen response)
    rejected_logratio = policy_rejected - reference_rejected
    h = chosen_logratio - rejected_logratio                       (how much more the policy prefers it)

Metrics are the implicit rewards of DPO, ``beta * logratio``: their means for chosen and rejected
responses, the mean margin, and the preference accuracy (share of pairs whose chosen response gets
the higher implicit reward). A loss may take keyword options beyond ``beta`` and
``label_smoothing`` (``dpo.loss_options``), and one that reads no reference log-probs registers with
``reads_reference=False`` (:func:`simpo`): its pipelines then start no reference role and pass it
zeros.

:func:`bradley_terry` is the explicit counterpart: the loss of a reward model (the ``reward_model``
pipeline) on the scores it gives both responses, with the same metrics of those scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PreferenceInput:
    """Sequence log-probs ``[B]``: summed over each response's tokens (IPO's callers pass the
    per-token mean instead, as its paper does; see :func:`ipo`)."""

    policy_chosen: torch.Tensor  # [B] under the current weights (requires grad)
    policy_rejected: torch.Tensor  # [B]
    reference_chosen: torch.Tensor  # [B] under the frozen reference
    reference_rejected: torch.Tensor  # [B]

    def logratios(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.policy_chosen - self.reference_chosen, self.policy_rejected - self.reference_rejected


def _metrics(chosen: torch.Tensor, rejected: torch.Tensor, beta: float) -> dict[str, float]:
    chosen_reward, rejected_reward = beta * chosen.detach(), beta * rejected.detach()
    return {
        "rewards/chosen": float(chosen_reward.mean()),
        "rewards/rejected": float(rejected_reward.mean()),
        "rewards/margin": float((chosen_reward - rejected_reward).mean()),
        "rewards/accuracy": float((chosen_reward > rejected_reward).float().mean()),
    }


def dpo_sigmoid(inputs: PreferenceInput, *, beta: float, label_smoothing: float = 0.0):
    """DPO's sigmoid loss (Rafailov et al. 2023, arXiv:2305.18290), with conservative label
    smoothing (cDPO, Mitchell 2023: each label is wrong with probability ``eps``)::

        loss = -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)

    ``eps = label_smoothing`` in ``[0, 0.5)``; ``eps = 0`` is plain DPO. Shapes: inputs ``[B]``;
    returns the loss ``[B]`` and scalar metrics.
    """
    chosen, rejected = inputs.logratios()
    logits = beta * (chosen - rejected)
    loss = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return loss, _metrics(chosen, rejected, beta)


def ipo(inputs: PreferenceInput, *, beta: float, label_smoothing: float = 0.0):
    """IPO (Azar et al. 2023, arXiv:2310.12036): regress the log-ratio gap onto a fixed margin
    instead of pushing it to infinity, so a deterministic preference cannot over-fit::

        loss = (h - 1 / (2 * beta))^2

    ``beta`` is the paper's tau (smaller means a larger target gap). The paper's log-probs are
    per-token means of each response, so pass those in :class:`PreferenceInput`. ``label_smoothing``
    is not used by IPO (accepted so every preference loss takes the same arguments). Shapes as
    :func:`dpo_sigmoid`.
    """
    chosen, rejected = inputs.logratios()
    loss = (chosen - rejected - 1 / (2 * beta)) ** 2
    return loss, _metrics(chosen, rejected, beta)


def simpo(inputs: PreferenceInput, *, beta: float, label_smoothing: float = 0.0, gamma: float = 0.5):
    """SimPO (Meng, Xia & Chen 2024, arXiv:2405.14734): DPO without a reference. The implicit reward
    is the policy's own length-normalised log-likelihood, and the chosen response must beat the
    rejected one by a target margin ``gamma``::

        h'   = policy_chosen - policy_rejected     (per-token means: registered average_log_probs=True)
        loss = -(1 - eps) * log sigmoid(beta * h' - gamma) - eps * log sigmoid(gamma - beta * h')

    The paper's ``beta`` is much larger than DPO's (2 to 10) and its ``gamma`` about half of it or
    less (``dpo.loss_options: {gamma: ...}``); ``eps`` is cDPO's label smoothing, as in
    :func:`dpo_sigmoid`. The reference log-probs are not read (registered ``reads_reference=False``,
    so no reference role starts). Shapes as :func:`dpo_sigmoid`; the metrics' rewards are
    ``beta * policy log-probs``.
    """
    logits = beta * (inputs.policy_chosen - inputs.policy_rejected) - gamma
    loss = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return loss, _metrics(inputs.policy_chosen, inputs.policy_rejected, beta)


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor):
    """A reward model's pairwise loss: the Bradley-Terry model (Bradley & Terry 1952) of
    ``P(chosen preferred) = sigmoid(r_chosen - r_rejected)``, fitted by maximum likelihood, as in the
    reward models of RLHF (Ouyang et al. 2022, arXiv:2203.02155, eq. 1)::

        loss = -log sigmoid(r_chosen - r_rejected)

    Only score differences enter it, so a constant added to every score changes nothing. Shapes:
    ``chosen`` and ``rejected`` ``[P]``, the scores of each pair's responses; returns the loss ``[P]``
    and scalar metrics (mean scores, margin and accuracy, as :func:`dpo_sigmoid`'s with beta 1).
    """
    return -F.logsigmoid(chosen - rejected), _metrics(chosen, rejected, 1.0)


def best_worst_pairs(scores: torch.Tensor, group_index: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Preference pairs from groups of scored samples of one prompt: in each group, the best-scored
    sample is chosen over the worst-scored one, as in online and iterative DPO with a scalar judge
    (Guo et al. 2024, arXiv:2402.04792, with two samples; best-of-n against worst-of-n in Dong et
    al. 2024, arXiv:2405.07863)::

        pair(g) = (argmax_{i in g} score_i, argmin_{i in g} score_i)    if max > min, else none

    A group whose samples all score alike (or any NaN) says nothing about which is better and gives
    no pair. Ties for best or worst go to the earlier sample. Only samples that ``keep`` (``[N]``
    bool, default all) holds take part: rlvr's sample masks (a truncated answer, a group outside
    the difficulty range) say which may be trained on. Shapes: ``scores`` and ``group_index`` ``[N]``
    (a rollout batch's rewards and group ids); returns row indices ``[P, 2]`` (chosen, rejected),
    one pair per group that has one, in group order.
    """
    pairs = []
    kept = torch.ones(len(scores), dtype=torch.bool) if keep is None else keep.bool()
    for group in torch.unique(group_index).tolist():  # sorted
        rows = ((group_index == group) & kept).nonzero().flatten()
        if len(rows) < 2:
            continue
        group_scores = scores[rows].float()
        best, worst = int(group_scores.argmax()), int(group_scores.argmin())
        if group_scores[best] > group_scores[worst]:
            pairs.append((int(rows[best]), int(rows[worst])))
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
