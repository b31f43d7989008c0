"""``numeric_closeness``: a dense reward for numeric answers.

Exact match gives a model nothing to climb until it is exactly right. This reward reads the first
number in the response and scores ``1 / (1 + |answer - truth| / scale)``: 1 when exact, 0.5 when
off by ``scale``, and 0 when the response has no number at all.
"""

from __future__ import annotations

import re

from roll_core.rewards import Reward, RewardInput

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class NumericCloseness(Reward):
    """Options: ``scale`` (the distance that halves the reward, default 1.0)."""

    def __init__(self, scale: float = 1.0):
        if scale <= 0:
            raise ValueError(f"numeric_closeness: scale must be > 0, got {scale}")
        self.scale = scale

    def score(self, sample: RewardInput) -> float:
        found = NUMBER.search(sample.response)
        if found is None:
            return 0.0
        distance = abs(float(found.group()) - float(sample.ground_truth))
        return 1.0 / (1.0 + distance / self.scale)

    @classmethod
    def contract_examples(cls):
        """Cases `roll check-plugin numeric` runs: (options, sample, expected score)."""
        return [
            ({}, RewardInput("47+38=", "085", "085"), 1.0),
            ({}, RewardInput("47+38=", "084", "085"), 0.5),
            ({"scale": 10.0}, RewardInput("47+38=", "075", "085"), 0.5),
            ({}, RewardInput("47+38=", "no idea", "085"), 0.0),
        ]
