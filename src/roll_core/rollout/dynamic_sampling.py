"""Dynamic sampling (DAPO): train only on groups that carry a learning signal.

A group whose samples all score the same (all right, all wrong) has zero GRPO advantage: it costs a
forward/backward pass and teaches nothing. The filter (:func:`roll_core.algorithms.shaping.keep_groups`,
``algorithm.dynamic_sampling``) drops such groups and the scheduler draws more prompts until a batch
is full, within a budget: ``max_rounds`` rounds of ``prompts_per_step`` prompts for ``sync``, and
``max_rounds * prompts_per_step`` rejected groups for ``async`` (which draws group by group). When the
budget runs out the batch is filled with rejected groups and the step says so (their advantages are
zero for GRPO-style estimators, so those samples are a no-op).

Both schedulers use this one class, so a step reports the same names whichever ran it:

==============================  ===========================================================
``rollout/filtered_groups``     groups the filter rejected while this batch was assembled
``rollout/kept_groups``         groups in the batch that passed the filter
``rollout/fallback_groups``     rejected groups used to fill the batch (budget exhausted)
``rollout/sampling_rounds``     ``sync`` only: rounds of ``prompts_per_step`` prompts drawn
==============================  ===========================================================
"""

from __future__ import annotations

import torch

from roll_core.algorithms.shaping import keep_groups


class DynamicSampling:
    """One step's filter decisions and counts. ``cfg`` is ``algorithm.dynamic_sampling``."""

    def __init__(self, cfg, prompts_per_step: int):
        self.cfg = cfg
        self.budget = cfg.max_rounds * prompts_per_step
        self.reset()

    @property
    def active(self) -> bool:
        return self.cfg.filter != "none"

    def reset(self) -> None:
        self.filtered = self.kept = self.fallback = self.rounds = 0

    def keep(self, scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: samples of groups that pass; counts the groups rejected."""
        mask = keep_groups(scores, group_index, self.cfg)
        self.filtered += len(group_index.unique()) - len(group_index[mask].unique())
        return mask

    def exhausted(self) -> bool:
        """Group by group: the step has rejected as many groups as it may."""
        return self.filtered >= self.budget

    def rounds_left(self) -> bool:
        """Round by round: fewer than ``max_rounds`` rounds drawn this step."""
        return self.rounds < self.cfg.max_rounds

    def metrics(self) -> dict[str, float]:
        """The step's counts (empty when no filter is configured); then starts a new step."""
        out = {}
        if self.active:
            out = {"rollout/filtered_groups": float(self.filtered), "rollout/kept_groups": float(self.kept),
                   "rollout/fallback_groups": float(self.fallback)}
            if self.rounds:
                out["rollout/sampling_rounds"] = float(self.rounds)
        self.reset()
        return out
