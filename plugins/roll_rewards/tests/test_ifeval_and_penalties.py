"""IFEval-style checks and the shaped reward (format + overlong penalties), on hand-made cases."""

import pytest

from roll_core.rewards import RewardInput
from roll_rewards.ifeval import IFEvalReward, follows
from roll_rewards.penalties import ShapedReward, overlong_penalty


@pytest.mark.parametrize("response, instruction, expected", [
    ("one two three", {"id": "length_constraints:number_words", "relation": "at least", "num_words": 3}, True),
    ("one two", {"id": "length_constraints:number_words", "relation": "at least", "num_words": 3}, False),
    ("one two", {"id": "length_constraints:number_words", "relation": "less than", "num_words": 3}, True),
    ("one two three", {"id": "length_constraints:number_words", "relation": "less than", "num_words": 3}, False),
    ("Hi. Bye.", {"id": "length_constraints:number_sentences", "relation": "exactly", "num_sentences": 2}, True),
    ("a *** b *** c", {"id": "length_constraints:number_paragraphs", "num_paragraphs": 3}, True),
    ("* x\n* y\n- z", {"id": "detectable_format:number_bullet_lists", "num_bullets": 3}, True),
    ('```json\n{"a": 1}\n```', {"id": "detectable_format:json_format"}, True),
    ("{a: 1}", {"id": "detectable_format:json_format"}, False),
    ("<<My Poem>>\nroses", {"id": "detectable_format:title"}, True),
    ("all lower case", {"id": "change_case:english_lowercase"}, True),
    ("Not Lower", {"id": "change_case:english_lowercase"}, False),
    ("SHOUT", {"id": "change_case:english_capital"}, True),
    ("I like rust and go", {"id": "keywords:existence", "keywords": ["Rust", "go"]}, True),
    ("I like rust", {"id": "keywords:existence", "keywords": ["Rust", "go"]}, False),  # every keyword
    ("I like rusty goats", {"id": "keywords:existence", "keywords": ["rust"]}, False),  # whole words
    ("I like rust", {"id": "keywords:forbidden_words", "forbidden_words": ["rust"]}, False),
    ("cat cat dog cat", {"id": "keywords:frequency", "keyword": "cat", "frequency": 3, "relation": "at least"}, True),
    ("Done. Is there anything else I can help with?",
     {"id": "startend:end_checker", "end_phrase": "Is there anything else I can help with?"}, True),
    ('"quoted"', {"id": "startend:quotation"}, True),
    ("no commas here", {"id": "punctuation:no_comma"}, True),
    ("a, b", {"id": "punctuation:no_comma"}, False),
    ("Body\nP.S. see you", {"id": "detectable_content:postscript", "postscript_marker": "P.S."}, True),
])
def test_checks(response, instruction, expected):
    assert follows(response, instruction) is expected


def test_ifeval_reward_is_the_fraction_followed():
    truth = [{"id": "punctuation:no_comma"}, {"id": "change_case:english_lowercase"},
             {"id": "length_constraints:number_words", "relation": "at least", "num_words": 10}]
    sample = RewardInput("", "short, lower", truth)
    assert IFEvalReward().score(sample) == pytest.approx(1 / 3)  # only lowercase holds
    assert IFEvalReward(all_or_nothing=True).score(sample) == 0.0


def test_unknown_instruction_names_the_known_ones():
    with pytest.raises(ValueError, match="Did you mean 'punctuation:no_comma'"):
        follows("x", {"id": "punctuation:no_commas"})


def test_overlong_penalty_by_hand():
    # max 100, buffer 20: no penalty up to 80 ; at 90: (80 - 90) / 20 = -0.5 ; beyond 100: -1
    assert overlong_penalty(80, 100, 20) == 0.0
    assert overlong_penalty(90, 100, 20) == -0.5
    assert overlong_penalty(101, 100, 20, factor=0.5) == -0.5
    assert overlong_penalty(81, 100, 20) == pytest.approx(-0.05)  # the first unit past the start
    assert overlong_penalty(90, 100, 20, factor=0.5) == pytest.approx(-0.25)  # the factor scales the ramp too
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(1, 10, 20)


def test_shaped_reward_format_and_overlong(roll_plugins):
    roll_plugins()
    reward = ShapedReward(reward="exact_match", format_pattern=r"^\d+$", format_penalty=-1.0,
                          overlong={"max_length": 4, "buffer": 2})
    samples = [RewardInput("", "42", "42"),      # well-formed, right, short: 1
               RewardInput("", "forty", "42"),   # malformed: -1 and overlong (5 > 4): -1 -> -2
               RewardInput("", "421", "42")]     # well-formed, wrong, length 3: (2 - 3) / 2 = -0.5
    assert reward.score_batch(samples) == [1.0, -2.0, -0.5]


# mutants that survived mutmut (the core's docs/testing.md): each case fails on at least one
@pytest.mark.parametrize("relation, value, expected", [
    (">=", 3, True), ("<", 3, False), ("<=", 3, True), ("at most", 3, True), ("at most", 4, False),
    ("<=", 2, True), ("==", 3, True), ("exactly", 2, False),
])
def test_symbolic_and_spelled_relations(relation, value, expected):
    words = " ".join(["w"] * value)
    assert follows(words, {"id": "length_constraints:number_words", "relation": relation, "num_words": 3}) is expected


def test_an_unknown_relation_and_an_unknown_check_are_named():
    with pytest.raises(ValueError, match="relation must be 'at least', 'less than', 'at most' or 'exactly', got 'about'"):
        follows("a b", {"id": "length_constraints:number_words", "relation": "about", "num_words": 3})
    with pytest.raises(ValueError, match=r"unknown instruction id None\..*Known ids: change_case:english_capital, "):
        follows("a b", {"num_words": 3})


def test_a_json_block_fenced_without_a_language_counts():
    assert follows('```\n{"a": 1}\n```', {"id": "detectable_format:json_format"})


def test_ifeval_ground_truth_as_list_or_json_text_and_empty_refused():
    ins = [{"id": "change_case:english_lowercase"}]
    assert IFEvalReward().score(RewardInput("p", "low", ins)) == 1.0
    assert IFEvalReward().score(RewardInput("p", "low", '[{"id": "change_case:english_lowercase"}]')) == 1.0
    for bad in ([], "[]", {"id": "change_case:english_lowercase"}):
        with pytest.raises(ValueError, match="ground_truth must be a non-empty list of instructions"):
            IFEvalReward().score(RewardInput("p", "low", bad))


def test_overlong_penalty_boundaries():
    # max_length 10, buffer 4: free up to 6, then linear to -1 at 10, -factor beyond
    assert overlong_penalty(6, 10, 4) == 0.0
    assert overlong_penalty(10, 10, 4) == pytest.approx(-1.0)
    assert overlong_penalty(11, 10, 4, factor=2.0) == -2.0
    assert overlong_penalty(3, 10, 10) == pytest.approx(-0.3)  # a buffer as long as the budget is allowed
    assert overlong_penalty(1, 10, 1) == 0.0  # the smallest buffer
    for buffer in (0, 11):
        with pytest.raises(ValueError, match=r"overlong buffer must be in \(0, max_length\]"):
            overlong_penalty(5, 10, buffer)


def test_shaped_reward_defaults_add_nothing_and_bad_overlong_options_fail_at_construction():
    base = ShapedReward("multiple_choice")
    assert base.score(RewardInput("p", "B", "B")) == 1.0  # no format penalty, no overlong by default
    with pytest.raises(ValueError, match="overlong buffer"):
        ShapedReward("multiple_choice", overlong={"max_length": 4, "buffer": 8})
