"""math_verify on real equivalences: fractions vs decimals, boxed answers, LaTeX vs plain text."""

import pytest

from roll_core.rewards import RewardInput
from roll_rewards.math import MathVerifyReward


@pytest.mark.parametrize("response, gold, expected", [
    (r"The answer is $\frac{1}{2}$.", "0.5", 1.0),           # fraction vs decimal
    (r"so the result is \boxed{0.5}", r"\frac{1}{2}", 1.0),  # decimal vs LaTeX fraction
    (r"\boxed{x = 3}", "3", 1.0),                             # an equation's right-hand side
    (r"\boxed{\sqrt{2}}", "2^{1/2}", 1.0),                    # symbolic equality
    (r"\boxed{50\%}", "0.5", 1.0),                            # percentages
    (r"\boxed{4}", "3", 0.0),                                 # wrong
    ("I could not solve it.", "5", 0.0),                      # no answer at all
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", 1.0),            # unsimplified
])
def test_equivalences(response, gold, expected):
    assert MathVerifyReward().score(RewardInput("", response, gold)) == expected


def test_boxed_only_ignores_unboxed_answers():
    reward = MathVerifyReward(boxed_only=True)
    assert reward.score(RewardInput("", "the answer is 7", "7")) == 0.0
    assert reward.score(RewardInput("", r"the answer is \boxed{7}", "7")) == 1.0


def test_registered_and_used_by_name(roll_plugins):
    plugins = roll_plugins()
    entry = plugins.rewards.entry("math_verify")
    assert entry.plugin == "rewards"
    reward = plugins.rewards.get("math_verify")(timeout_seconds=2)
    assert reward.score_batch([RewardInput("", r"\boxed{1/4}", "0.25")]) == [1.0]


def test_boxed_only_refuses_an_unboxed_answer_that_the_default_accepts():
    from roll_core.rewards import RewardInput
    from roll_rewards.math import MathVerifyReward

    for response in ("The answer is 3", "so we get $3$"):
        assert MathVerifyReward().score(RewardInput("q", response, "3")) == 1.0
        assert MathVerifyReward(boxed_only=True).score(RewardInput("q", response, "3")) == 0.0
    assert MathVerifyReward(boxed_only=True).score(RewardInput("q", "\\boxed{3}", "3")) == 1.0


def test_float_rounding_decides_close_decimals():
    from roll_core.rewards import RewardInput
    from roll_rewards.math import MathVerifyReward

    sample = RewardInput("q", "\\boxed{0.33}", "0.3333")
    assert MathVerifyReward().score(sample) == 0.0  # 6 digits by default
    assert MathVerifyReward(float_rounding=2).score(sample) == 1.0
