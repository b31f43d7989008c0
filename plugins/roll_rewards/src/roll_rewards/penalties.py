"""``shaped``: any registered reward plus a format penalty and DAPO's soft overlong penalty.

    roles:
      reward:
        name: shaped
        options:
          reward: math_verify                    # the base reward, any registered name
          reward_options: {timeout_seconds: 5}
          format_pattern: "(?s)<think>.*</think>.*\\\\boxed\\\\{.*\\\\}"   # must match, else ...
          format_penalty: -1.0                   # ... the score is this (the base reward is skipped)
          overlong: {max_length: 4096, buffer: 1024, factor: 1.0}

Overlong penalty (Yu et al. 2025, DAPO, arXiv:2503.14476), added to the base score, with ``L`` the
response length in characters (rewards see text, not tokens; scale ``max_length`` accordingly):

    0                              if L <= max_length - buffer
    ((max_length - buffer) - L) / buffer * factor    if max_length - buffer < L <= max_length
    -factor                        if L > max_length
"""

from __future__ import annotations

import re
from typing import Any

from roll_core.rewards import Reward, RewardInput


def overlong_penalty(length: int, max_length: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment, linear over the last ``buffer`` units before ``max_length``."""
    if buffer <= 0 or buffer > max_length:
        raise ValueError(f"overlong buffer must be in (0, max_length], got {buffer} with max_length {max_length}")
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length <= max_length:
        return (start - length) / buffer * factor
    return -factor


class ShapedReward(Reward):
    def __init__(self, reward: str, reward_options: dict[str, Any] | None = None, format_pattern: str | None = None,
                 format_penalty: float = 0.0, overlong: dict[str, Any] | None = None):
        from roll_core.plugins import get_plugins

        self.base = get_plugins().rewards.get(reward)(**(reward_options or {}))
        self.pattern = re.compile(format_pattern) if format_pattern else None
        self.format_penalty = format_penalty
        self.overlong = overlong
        if overlong is not None:
            overlong_penalty(0, **overlong)  # validate the options now, not at the first long sample

    def score_batch(self, samples: list[RewardInput]) -> list[float]:
        well_formed = [self.pattern is None or bool(self.pattern.search(s.response)) for s in samples]
        base = iter(self.base.score_batch([s for s, ok in zip(samples, well_formed) if ok]))
        scores = [float(next(base)) if ok else self.format_penalty for ok in well_formed]
        if self.overlong is not None:
            scores = [x + overlong_penalty(len(s.response), **self.overlong) for x, s in zip(scores, samples)]
        return scores

    @classmethod
    def contract_examples(cls):
        options = {"reward": "exact_match", "format_pattern": r"^\d+$", "format_penalty": -1.0}
        return [(options, RewardInput("1+1=", "2", "2"), 1.0), (options, RewardInput("1+1=", "two", "2"), -1.0)]

    def score(self, sample: RewardInput) -> float:
        return self.score_batch([sample])[0]
