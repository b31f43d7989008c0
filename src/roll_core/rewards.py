"""Reward interface, and the built-in verifiable rewards of the core.

A reward scores one finished sample. Rewards are registered by name through
``roll_register_rewards`` and run inside reward workers, so a slow reward never blocks generation
once rollout is asynchronous; a reward that declares itself :attr:`Reward.lightweight` scores in
the driver instead (``roles.reward.placement: auto``), as a string comparison costs far less than
a round trip to another process. Richer rewards (math-verify, code sandboxes, judges) live in the
``roll_rewards`` plugin.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class RewardInput:
    """One finished sample, as a reward sees it.

    ``prompt``: the row's prompt text exactly as given to the model (after the chat template when
    the data is rendered through one). ``response``: the generated tokens decoded with
    ``skip_special_tokens=True``: no end-of-sequence or padding token, not stripped (leading and
    trailing whitespace and newlines are the model's own; a response cut at ``max_new_tokens`` is
    simply shorter than intended). ``ground_truth``: the row's ``ground_truth`` value unchanged, of
    whatever JSON type the data has (a string for the built-in datasets; a list of test cases for
    ``code``). ``domain``: the row's domain (``"default"`` outside multi-domain runs). ``extra``:
    anything else a pipeline passes (empty for ``rlvr``)."""

    prompt: str
    response: str
    ground_truth: Any
    domain: str = "default"
    extra: dict[str, Any] = field(default_factory=dict)


class Reward(ABC):
    """Constructed with the ``roles.reward.options`` of the config as keyword arguments."""

    #: True for a quick, pure function of its inputs (string or regular-expression checks): no model,
    #: no sandbox, no service, nothing that can hang. With ``placement: auto`` (the default) a reward
    #: role whose rewards all say so scores in the driver process, which saves every generation
    #: request a round trip to a reward worker. Anything else keeps the default, False: a reward
    #: worker contains its hangs and crashes (:class:`~roll_core.runtime.reward_worker.RewardWorker`).
    lightweight: ClassVar[bool] = False

    def __init__(self, **options: Any):
        if options:
            raise TypeError(f"{type(self).__name__} takes no options, got {sorted(options)}")

    @abstractmethod
    def score(self, sample: RewardInput) -> float:
        """The reward of one sample (a float; 1.0 = correct for verifiable tasks)."""

    # Optional: ``@classmethod contract_examples(cls) -> [(options, RewardInput, expected score or
    # None), ...]``, the cases ``roll check-plugin`` scores (see roll_core.contracts). Without it the
    # reward is built without options and scored on generic inputs.

    def score_batch(self, samples: list[RewardInput]) -> list[float]:
        return [float(self.score(s)) for s in samples]

    def metrics(self) -> dict[str, float]:
        """Counts since the last call (an LLM judge's retries, unparsable verdicts, ...). The run
        reports them every step as ``reward/<name>/<key>``, summed over the reward's workers."""
        return {}

    def close(self) -> None:
        """Release what the reward holds beyond its own memory: a process pool of verifiers, a
        container, a connection to a judge. Called once, when the run ends or its worker is replaced
        or restarted (on Ray before the worker's process ends, within ``close_timeout_s``). A reward
        abandoned after a timeout is not closed (its call may still be using it): its worker is
        replaced, and on Ray its process ends. Optional; the default holds nothing."""


class ExactMatch(Reward):
    """1.0 when the response equals the ground truth after stripping whitespace, else 0.0.

    Options: ``strip`` (default True), ``case_sensitive`` (default True).
    """

    lightweight = True

    def __init__(self, strip: bool = True, case_sensitive: bool = True):
        self.strip, self.case_sensitive = strip, case_sensitive

    def _norm(self, text: Any) -> str:
        text = str(text)
        text = text.strip() if self.strip else text
        return text if self.case_sensitive else text.lower()

    def score(self, sample: RewardInput) -> float:
        return float(self._norm(sample.response) == self._norm(sample.ground_truth))

    @classmethod
    def contract_examples(cls):
        return [({}, RewardInput("47+38=", " 085\n", "085"), 1.0), ({}, RewardInput("47+38=", "075", "085"), 0.0),
                ({"case_sensitive": False}, RewardInput("Capital?", "paris", "Paris"), 1.0)]
