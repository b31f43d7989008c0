"""Adapters: existing reward functions from other libraries, used unchanged by name.

* ``trl_function``: a TRL-style reward function ``f(prompts, completions, **columns) -> list[float | None]``
  (``columns`` are the dataset's other columns, one list each: here ``ground_truth``, ``domain`` and
  every key of the sample's ``extra``). ``None`` ("does not apply to this sample") scores 0.
* ``verl_compute_score``: a verl-style ``compute_score(data_source, solution_str, ground_truth,
  extra_info)`` returning a float or a dict with a ``"score"`` key; ``data_source`` is the domain.

Both take the function as an import path, ``options: {function: "my_pkg.rewards:accuracy"}``.
"""

from __future__ import annotations

from roll_core.registry import import_target
from roll_core.rewards import Reward, RewardInput


def _load(function: str):
    try:
        fn = import_target(function)
    except Exception as exc:
        raise ValueError(f"cannot import reward function {function!r}: {type(exc).__name__}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"{function!r} is not callable")
    return fn


def exact_match_completions(prompts, completions, ground_truth, **columns):
    """A TRL-style reward function (the shape ``trl_function`` takes): 1.0 per exact completion."""
    return [float(c.strip() == str(t).strip()) for c, t in zip(completions, ground_truth)]


def exact_match_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A verl-style ``compute_score`` (the shape ``verl_compute_score`` takes)."""
    return {"score": float(solution_str.strip() == str(ground_truth).strip())}


def _examples(function: str):
    options = {"function": function}
    return [(options, RewardInput("1+1=", "2", "2"), 1.0), (options, RewardInput("1+1=", "3", "2"), 0.0)]


class TRLRewardFunction(Reward):
    def __init__(self, function: str):
        self.fn = _load(function)

    @classmethod
    def contract_examples(cls):
        return _examples("roll_rewards.adapters:exact_match_completions")

    def score(self, sample: RewardInput) -> float:
        return self.score_batch([sample])[0]

    def score_batch(self, samples: list[RewardInput]) -> list[float]:
        columns = {"ground_truth": [s.ground_truth for s in samples], "domain": [s.domain for s in samples]}
        for key in sorted({k for s in samples for k in s.extra}):
            columns[key] = [s.extra.get(key) for s in samples]
        out = self.fn(prompts=[s.prompt for s in samples], completions=[s.response for s in samples], **columns)
        if len(out) != len(samples):
            raise ValueError(f"reward function returned {len(out)} values for {len(samples)} completions")
        return [0.0 if v is None else float(v) for v in out]


class VerlComputeScore(Reward):
    def __init__(self, function: str):
        self.fn = _load(function)

    @classmethod
    def contract_examples(cls):
        return _examples("roll_rewards.adapters:exact_match_compute_score")

    def score(self, sample: RewardInput) -> float:
        out = self.fn(sample.domain, sample.response, sample.ground_truth, dict(sample.extra))
        return float(out["score"] if isinstance(out, dict) else out)
