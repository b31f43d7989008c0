"""Multi-turn episodes as training rows: the mask, the turns, GiGPO's state groups, truncation."""

from __future__ import annotations

import pytest
import torch

from roll_core.agentic.samples import Episode, Turn, episode_batch, fit_turns, turn_token_rewards
from roll_core.algorithms.advantages import AdvantageInput, gigpo, turn_rewards
from roll_core.config.schema import AlgorithmConfig

PAD = 0


def turn(obs, act, reward=0.0, state=0):
    return Turn(observation_ids=obs, action_ids=act, action_log_probs=[-0.5] * len(act), reward=reward,
                state_hash=state)


def test_the_response_mask_covers_exactly_the_generated_tokens_and_turns_line_up():
    episode = Episode([turn([11, 12, 13], [21, 22], state=7), turn([31], [41, 42, 43], reward=1.0, state=8)], group=0)
    short = Episode([turn([14], [51], reward=0.5, state=7)], group=0)
    batch = episode_batch([episode, short], PAD, max_length=64)
    assert batch["prompt_ids"].tolist() == [[11, 12, 13], [PAD, PAD, 14]]
    assert batch["prompt_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["responses"].tolist() == [[21, 22, 31, 41, 42, 43], [51, PAD, PAD, PAD, PAD, PAD]]
    assert batch["response_mask"].tolist() == [[1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]]  # attended: every real token
    assert batch["action_mask"].tolist() == [[1, 1, 0, 1, 1, 1], [1, 0, 0, 0, 0, 0]]  # trained: the reply 31 is context
    assert batch["turn_index"].tolist() == [[0, 0, -1, 1, 1, 1], [0, -1, -1, -1, -1, -1]]
    assert batch["infer_log_probs"].tolist() == [[-0.5, -0.5, 0, -0.5, -0.5, -0.5], [-0.5, 0, 0, 0, 0, 0]]
    assert batch["turn_rewards"].tolist() == [[0.0, 1.0], [0.5, 0.0]]
    assert batch["state_hash"].tolist() == [[7, 8], [7, 0]]
    # each turn's reward lands on its action's last token, and the estimators read it back per turn
    tokens = turn_token_rewards(batch["turn_rewards"], batch["turn_index"])
    assert tokens.tolist() == [[0, 0, 0, 0, 0, 1.0], [0.5, 0, 0, 0, 0, 0]]
    per_turn, valid, _ = turn_rewards(AdvantageInput(tokens, batch["action_mask"].float(), batch["group_index"],
                                                     turn_index=batch["turn_index"]))
    assert per_turn.tolist() == [[0.0, 1.0], [0.5, 0.0]] and valid.tolist() == [[True, True], [True, False]]


def test_gigpo_step_groups_are_keyed_by_the_state():
    """Two episodes of one group both act in state 5 first (a step group of two), then in states 6
    and 9 (groups of one). Rewards 1 and 0 at the end, gamma 1: the episode advantage is
    (R - mean) / std = 0.5 / 0.7071 = +-0.7071 (unbiased std of [1, 0]); state 5's returns are 1 and
    0, the same numbers, so its step advantage is +-0.7071 too; lone states add 0. The reply token
    between the turns gets nothing."""
    a = Episode([turn([1], [2], state=5), turn([3], [4], reward=1.0, state=6)], group=3)
    b = Episode([turn([1], [2], state=5), turn([3], [4], reward=0.0, state=9)], group=3)
    batch = episode_batch([a, b], PAD, max_length=64)
    tokens = turn_token_rewards(batch["turn_rewards"], batch["turn_index"])
    cfg = AlgorithmConfig(gigpo_step_weight=1.0, gamma=1.0)
    adv, _ = gigpo(AdvantageInput(tokens, batch["action_mask"].float(), batch["group_index"],
                                  turn_index=batch["turn_index"], state_hash=batch["state_hash"]), cfg)
    e = s = 0.5 / (0.5 ** 0.5)
    torch.testing.assert_close(adv, torch.tensor([[e + s, 0.0, e + 0.0], [-e - s, 0.0, -e + 0.0]]), atol=1e-4, rtol=0)
    # renumbering state 6 as 5 would join it to the first step group: keyed by the state, not the turn
    c = Episode([turn([1], [2], state=5), turn([3], [4], reward=1.0, state=5)], group=3)
    batch = episode_batch([c, b], PAD, max_length=64)
    tokens = turn_token_rewards(batch["turn_rewards"], batch["turn_index"])
    joined, _ = gigpo(AdvantageInput(tokens, batch["action_mask"].float(), batch["group_index"],
                                     turn_index=batch["turn_index"], state_hash=batch["state_hash"]), cfg)
    assert float(joined[0, 2]) != pytest.approx(float(adv[0, 2]))


def test_a_conversation_longer_than_the_context_is_cut_at_a_turn_boundary():
    long = Episode([turn([1, 2], [3, 4], state=1), turn([5, 6], [7, 8], state=2), turn([9], [10], reward=1.0, state=3)],
                   group=0)
    cut = fit_turns(long, max_length=9)  # turns of 4, 4 and 2 tokens: the third does not fit
    assert cut.truncated and len(cut.turns) == 2 and cut.reward == 0.0  # its reward went with it
    assert fit_turns(long, max_length=10) is long and not long.truncated
    batch = episode_batch([long], PAD, max_length=9)
    assert batch["responses"].tolist() == [[3, 4, 5, 6, 7, 8]] and batch["truncated"].tolist() == [True]
    assert int(batch["prompt_mask"].sum() + batch["responses"].ne(PAD).sum()) <= 9
    with pytest.raises(ValueError, match="the first turn of an episode has 4 tokens, more than max_length=3"):
        fit_turns(long, max_length=3)


def test_a_turn_must_carry_one_log_prob_per_action_token():
    with pytest.raises(ValueError, match="a turn has 2 action tokens but 1 log-probs"):
        Turn([1], [2, 3], [-0.1])
    with pytest.raises(ValueError, match="^a turn needs at least one action token$"):
        Turn([1], [], [])


def test_a_one_token_action_gets_its_turn_reward():
    rewards = turn_token_rewards(torch.tensor([[0.5]]), torch.tensor([[0]]))
    assert rewards.tolist() == [[0.5]]


def test_shaping_trains_the_actions_with_each_turns_reward():
    """agentic_reinforce, gamma 1, one group of two: episode A earns 0 then 1, B earns 0.5.
    Returns: A (1, 1), B (0.5); group mean of full returns 0.75; advantages A (0.25, 0.25), B -0.25,
    on action tokens only, and the loss mask is the action mask."""
    from roll_core.algorithms.shaping import RewardShaper
    from roll_core.plugins import get_plugins

    a = Episode([turn([11], [21, 22], state=1), turn([31], [41], reward=1.0, state=2)], group=0)
    b = Episode([turn([12], [51], reward=0.5, state=1)], group=0)
    batch = episode_batch([a, b], PAD, max_length=64)
    RewardShaper(AlgorithmConfig(advantage_estimator="agentic_reinforce", gamma=1.0), get_plugins()).shape(batch)
    torch.testing.assert_close(batch["advantages"], torch.tensor([[0.25, 0.25, 0.0, 0.25], [-0.25, 0, 0, 0]]))
    assert batch["loss_mask"].tolist() == batch["action_mask"].float().tolist()
    assert batch["token_level_rewards"].tolist() == [[0, 0, 0, 1.0], [0.5, 0, 0, 0]]
    assert batch["scores"].tolist() == [1.0, 0.5]


def test_every_index_and_mask_is_an_integer_tensor_and_state_hashes_stay_exact():
    big = 4_000_000_123  # a CRC-32 near its top: a float32 tensor would round it to a neighbour's hash
    episodes = [Episode([turn([11], [21], state=big), turn([31], [41], state=big + 1)], group=3, failed=True),
                Episode([turn([12, 13], [22], reward=2.0)], group=5, truncated=True)]
    batch = episode_batch(episodes, PAD, max_length=64)
    for key in ("prompt_ids", "prompt_mask", "responses", "response_mask", "action_mask", "turn_index", "state_hash",
                "group_index"):
        assert batch[key].dtype == torch.long, key
    assert batch["state_hash"][0].tolist() == [big, big + 1]
    assert batch["group_index"].tolist() == [3, 5] and batch["scores"].dtype == torch.float32
    assert batch["scores"].tolist() == [0.0, 2.0]
    assert batch["failed"].tolist() == [True, False] and batch["truncated"].tolist() == [False, True]
    assert turn_token_rewards(batch["turn_rewards"], batch["turn_index"]).dtype == torch.float32


def test_fit_turns_names_what_cannot_become_a_row_and_keeps_the_episode_facts():
    with pytest.raises(ValueError, match=r"an episode without turns \(its environment failed at reset\) is not a "
                                         r"training row; leave it out of the batch"):
        fit_turns(Episode([], group=0), 10)
    with pytest.raises(ValueError, match="the first turn of an episode has 5 tokens, more than max_length=4"):
        fit_turns(Episode([turn([1, 2, 3], [4, 5]), turn([6], [7])], group=0), 4)
    cut = fit_turns(Episode([turn([1], [2]), turn([3], [4])], group=2, failed=True, info={"error": "x"}), 3)
    assert len(cut.turns) == 1 and cut.truncated and cut.failed and cut.info == {"error": "x"} and cut.group == 2

