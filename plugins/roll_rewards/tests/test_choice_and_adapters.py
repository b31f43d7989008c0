"""multiple_choice extraction, and TRL / verl reward functions used unchanged through the adapters."""

import sys
import textwrap

import pytest

from roll_core.rewards import RewardInput
from roll_rewards.adapters import TRLRewardFunction, VerlComputeScore
from roll_rewards.choice import MultipleChoiceReward, extract_choice


@pytest.mark.parametrize("response, letter", [
    ("The answer is (B).", "B"),
    ("Reasoning... so \\boxed{D}", "D"),
    ("A is wrong because... Answer: c", "C"),
    ("Options (A) and (C) look close; I pick (C)", "C"),
    ("It must be J", "J"),
    ("a quick look says nothing", None),
])
def test_extract_choice(response, letter):
    assert extract_choice(response) == letter


def test_multiple_choice_reward():
    reward = MultipleChoiceReward()
    assert reward.score(RewardInput("", "the answer is b", "(B)")) == 1.0
    assert reward.score(RewardInput("", "the answer is A", "B")) == 0.0


@pytest.fixture
def legacy_module(tmp_path, monkeypatch):
    (tmp_path / "legacy_rewards.py").write_text(textwrap.dedent('''
        def accuracy(prompts, completions, ground_truth, **kwargs):
            # TRL style: one list per column; None = not applicable
            return [None if g is None else float(c.strip() == g) for c, g in zip(completions, ground_truth)]

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            # verl style; a dict with a score is allowed too
            bonus = extra_info.get("bonus", 0.0) if extra_info else 0.0
            return {"score": float(solution_str.strip() == ground_truth) + bonus, "acc": 1}
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("legacy_rewards", None)


def test_trl_style_function_unchanged(legacy_module):
    reward = TRLRewardFunction(function="legacy_rewards:accuracy")
    samples = [RewardInput("p", " 42", "42"), RewardInput("p", "41", "42"), RewardInput("p", "x", None)]
    assert reward.score_batch(samples) == [1.0, 0.0, 0.0]


def test_verl_style_function_unchanged(legacy_module):
    reward = VerlComputeScore(function="legacy_rewards:compute_score")
    assert reward.score(RewardInput("p", "42", "42", domain="gsm8k", extra={"bonus": 0.5})) == 1.5


def test_bad_import_path_is_explained():
    with pytest.raises(ValueError, match="cannot import reward function 'nope.nothing:f'"):
        TRLRewardFunction(function="nope.nothing:f")


SEEN: dict = {}


def recording_trl(prompts, completions, **columns):
    SEEN["trl"] = {"prompts": prompts, "completions": completions, **columns}
    return [None, 0.5]


def recording_verl(data_source, solution_str, ground_truth, extra_info):
    SEEN["verl"] = (data_source, solution_str, ground_truth, extra_info)
    return 0.25


def test_adapters_pass_every_column_and_argument_through():
    from roll_rewards.adapters import TRLRewardFunction, VerlComputeScore

    samples = [RewardInput("p1", "c1", "g1", domain="math", extra={"level": 1}),
               RewardInput("p2", "c2", "g2", domain="code", extra={"lang": "py"})]
    assert TRLRewardFunction(f"{__name__}:recording_trl").score_batch(samples) == [0.0, 0.5]
    assert SEEN["trl"] == {"prompts": ["p1", "p2"], "completions": ["c1", "c2"], "ground_truth": ["g1", "g2"],
                           "domain": ["math", "code"], "level": [1, None], "lang": [None, "py"]}
    assert VerlComputeScore(f"{__name__}:recording_verl").score(samples[0]) == 0.25  # a plain float
    assert SEEN["verl"] == ("math", "c1", "g1", {"level": 1})


def test_adapters_name_a_bad_function():
    from roll_rewards.adapters import TRLRewardFunction

    with pytest.raises(ValueError, match=r"cannot import reward function 'nowhere:f': ModuleNotFoundError"):
        TRLRewardFunction("nowhere:f")
    with pytest.raises(ValueError, match=r"is not callable"):
        TRLRewardFunction(f"{__name__}:SEEN")
    with pytest.raises(ValueError, match="returned 2 values for 1 completions"):
        TRLRewardFunction(f"{__name__}:recording_trl").score_batch([RewardInput("p", "c", "g")])
