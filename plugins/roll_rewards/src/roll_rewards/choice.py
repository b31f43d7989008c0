"""``multiple_choice``: the response's final choice letter against the gold letter.

The last of these wins: ``\\boxed{C}``, "answer is C" / "answer: (C)", or a letter standing alone
in parentheses or at the end. Letters ``A`` to ``J`` (MMLU-Pro has ten options); case-insensitive
only inside the explicit patterns, so the article "a" never counts as a choice.
"""

from __future__ import annotations

import re

from roll_core.rewards import Reward, RewardInput

_EXPLICIT = re.compile(r"\\boxed\{\s*\(?([A-Ja-j])\)?\s*\}|answer(?: is|:)?\s*\(?([A-Ja-j])\)?(?![A-Za-z])",
                       re.IGNORECASE)
_BARE = re.compile(r"\(([A-J])\)|(?<![A-Za-z])([A-J])[.)]?\s*$")


def extract_choice(response: str) -> str | None:
    explicit = [a or b for a, b in _EXPLICIT.findall(response)]
    if explicit:
        return explicit[-1].upper()
    bare = [a or b for a, b in _BARE.findall(response.strip())]
    return bare[-1] if bare else None


class MultipleChoiceReward(Reward):
    """1.0 when the extracted letter equals ``ground_truth`` (a letter, or ``"(B)"``), else 0.0."""

    lightweight = True  # two regular expressions without nested repetition: scored in the driver

    @classmethod
    def contract_examples(cls):
        return [({}, RewardInput("Q? (A) x (B) y", "The answer is (B).", "B"), 1.0),
                ({}, RewardInput("Q? (A) x (B) y", "Answer: A", "(B)"), 0.0)]

    def score(self, sample: RewardInput) -> float:
        gold = str(sample.ground_truth).strip().strip("()").upper()
        return float(extract_choice(sample.response) == gold)
