"""``math_verify``: answers checked for mathematical equivalence with Hugging Face's math-verify.

The gold answer and the response are both parsed (LaTeX, ``\\boxed{}`` answers, plain expressions)
into sympy objects and compared symbolically, so ``\\frac{1}{2}``, ``0.5`` and ``1/2`` agree and
``\\boxed{x = 3}`` matches ``3``. Parsing and comparison have timeouts: a response built to make
sympy spin scores 0 instead of hanging the reward worker.

math-verify times out with ``signal.alarm``, which only works in a process's main thread; in any
other thread the timeouts are disabled rather than crashing (reward workers call rewards from their
main thread).
"""

from __future__ import annotations

import threading

from roll_core.rewards import Reward, RewardInput


class MathVerifyReward(Reward):
    """Options: ``timeout_seconds`` (default 5), ``float_rounding`` (default 6 digits),
    ``boxed_only`` (default False: also accept an unboxed final answer)."""

    def __init__(self, timeout_seconds: int = 5, float_rounding: int = 6, boxed_only: bool = False):
        from math_verify import ExprExtractionConfig, LatexExtractionConfig  # fail at construction if missing

        self.timeout, self.float_rounding = timeout_seconds, float_rounding
        latex = LatexExtractionConfig(try_extract_without_anchor=not boxed_only, boxed_match_priority=0)
        self.pred_config = [latex] if boxed_only else [latex, ExprExtractionConfig()]
        self.gold_config = [LatexExtractionConfig(), ExprExtractionConfig()]

    @classmethod
    def contract_examples(cls):
        """Samples for ``roll check-plugin``: (options, sample, expected score)."""
        return [({}, RewardInput("1/2 as a decimal?", "The answer is $\\boxed{0.5}$", "\\frac{1}{2}"), 1.0),
                ({}, RewardInput("2+2?", "\\boxed{5}", "4"), 0.0)]

    def score(self, sample: RewardInput) -> float:
        from math_verify import parse, verify

        timeout = self.timeout if threading.current_thread() is threading.main_thread() else None
        gold_text = str(sample.ground_truth)
        if "$" not in gold_text and "\\boxed" not in gold_text:
            gold_text = f"${gold_text}$"  # a bare gold answer is read as LaTeX math
        gold = parse(gold_text, self.gold_config, parsing_timeout=timeout)
        pred = parse(sample.response, self.pred_config, parsing_timeout=timeout)
        if not gold or not pred:
            return 0.0
        return float(verify(gold, pred, float_rounding=self.float_rounding, timeout_seconds=timeout))
