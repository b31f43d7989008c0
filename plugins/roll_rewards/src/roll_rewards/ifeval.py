"""``ifeval``: instruction-following rule checks in the style of IFEval (Zhou et al. 2023, arXiv:2311.07911).

``ground_truth`` is a list of instructions (or its JSON text), each a dict with an ``id`` and its
arguments, e.g. ``[{"id": "length_constraints:number_words", "relation": "at least", "num_words": 50},
{"id": "punctuation:no_comma"}]``. The score is the fraction of instructions followed
(``all_or_nothing=True``: 1 only when every one is). Unknown ids are a clear error naming the
known ones. ``CHECKS`` maps each id to a small function ``(response, **args) -> bool``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from roll_core.errors import did_you_mean
from roll_core.rewards import Reward, RewardInput


def _compare(value: int, relation: str, target: int) -> bool:
    if relation in ("at least", ">="):
        return value >= target
    if relation in ("less than", "<"):
        return value < target
    if relation in ("at most", "<="):
        return value <= target
    if relation in ("exactly", "=="):
        return value == target
    raise ValueError(f"relation must be 'at least', 'less than', 'at most' or 'exactly', got {relation!r}")


def _words(text: str) -> list[str]:
    return re.findall(r"\b\w+\b", text)


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def _json(text: str) -> bool:
    body = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    try:
        json.loads(body)
        return True
    except ValueError:
        return False


CHECKS: dict[str, Callable[..., bool]] = {
    "keywords:existence": lambda r, keywords: all(re.search(rf"\b{re.escape(k)}\b", r, re.I) for k in keywords),
    "keywords:forbidden_words": lambda r, forbidden_words: not any(
        re.search(rf"\b{re.escape(w)}\b", r, re.I) for w in forbidden_words),
    "keywords:frequency": lambda r, keyword, frequency, relation="at least": _compare(
        len(re.findall(rf"\b{re.escape(keyword)}\b", r, re.I)), relation, frequency),
    "length_constraints:number_words": lambda r, num_words, relation="at least": _compare(
        len(_words(r)), relation, num_words),
    "length_constraints:number_sentences": lambda r, num_sentences, relation="at least": _compare(
        len(_sentences(r)), relation, num_sentences),
    "length_constraints:number_paragraphs": lambda r, num_paragraphs: len(
        [p for p in re.split(r"\s*\*\*\*\s*", r.strip()) if p.strip()]) == num_paragraphs,
    "detectable_format:number_bullet_lists": lambda r, num_bullets: len(
        re.findall(r"^\s*[*-]\s", r, re.M)) == num_bullets,
    "detectable_format:json_format": lambda r: _json(r),
    "detectable_format:title": lambda r: bool(re.search(r"<<[^\n<>]+>>", r)),
    "change_case:english_lowercase": lambda r: r == r.lower() and any(c.isalpha() for c in r),
    "change_case:english_capital": lambda r: r == r.upper() and any(c.isalpha() for c in r),
    "startend:end_checker": lambda r, end_phrase: r.strip().lower().endswith(end_phrase.strip().lower()),
    "startend:quotation": lambda r: len(r.strip()) > 1 and r.strip()[0] == '"' and r.strip()[-1] == '"',
    "punctuation:no_comma": lambda r: "," not in r,
    "detectable_content:postscript": lambda r, postscript_marker="P.S.": bool(
        re.search(rf"^\s*{re.escape(postscript_marker)}", r, re.M | re.I)),
}


def follows(response: str, instruction: dict[str, Any]) -> bool:
    args = dict(instruction)
    check_id = args.pop("id", None)
    if check_id not in CHECKS:
        raise ValueError(f"unknown instruction id {check_id!r}.{did_you_mean(str(check_id), CHECKS)} "
                         f"Known ids: {', '.join(sorted(CHECKS))}")
    return bool(CHECKS[check_id](response, **args))


class IFEvalReward(Reward):
    """Options: ``all_or_nothing`` (default False: the fraction of instructions followed)."""

    def __init__(self, all_or_nothing: bool = False):
        self.all_or_nothing = all_or_nothing

    @classmethod
    def contract_examples(cls):
        rules = [{"id": "punctuation:no_comma"}, {"id": "change_case:english_lowercase"}]
        return [({}, RewardInput("Describe rain.", "wet and grey", rules), 1.0),
                ({"all_or_nothing": True}, RewardInput("Describe rain.", "Wet, grey", rules), 0.0)]

    def score(self, sample: RewardInput) -> float:
        truth = sample.ground_truth
        instructions = json.loads(truth) if isinstance(truth, str) else truth
        if not isinstance(instructions, list) or not instructions:
            raise ValueError("ifeval: ground_truth must be a non-empty list of instructions")
        results = [follows(sample.response, ins) for ins in instructions]
        return float(all(results)) if self.all_or_nothing else sum(results) / len(results)
