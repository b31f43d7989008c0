"""The multi-turn loop: episodes played against a policy become the rows the trainer sees, token
for token; a failing environment ends its episode only; long conversations are cut."""

from __future__ import annotations

import threading

import pytest
import torch

from roll_core.agentic.env_workers import EnvFailed, EnvHung
from roll_core.agentic.episodes import (Rules, TurnFormat, engine_policy, play, play_one, scripted_policy,
                                        teacher_policy, transcript)
from roll_core.agentic.samples import episode_batch
from roll_core.embedded.model import build_char_tokenizer
from roll_core.envs import Env
from roll_core.pipelines.runtime import load_tokenizer


class Counter(Env):
    """Says how many replies it has seen; reward 1 for a reply 'a', done after 3 replies."""

    def reset(self, seed=None):
        self.n, self.seed = 0, seed or 0
        return f"s{self.seed}n0", {"state_hash": 100 * self.seed}

    def step(self, action):
        self.n += 1
        return f"n{self.n}", float(action.strip() == "a"), self.n >= 3, False, {"state_hash": 100 * self.seed + self.n,
                                                                                "success": self.n >= 3}


class Explodes(Counter):
    def step(self, action):
        if self.n == 1:
            raise RuntimeError("the simulator crashed")
        return super().step(action)


def test_scripted_episodes_become_rows_turn_by_turn(tiny_model_path):
    tokenizer = load_tokenizer(str(tiny_model_path))
    policy = scripted_policy(["a", "b", "a"], tokenizer)
    episodes = play([Counter(), Counter()], seeds=[1, 2], groups=[0, 0], policy=policy, tokenizer=tokenizer,
                    turn_format=TurnFormat(instruction="go "))
    first = episodes[0]
    assert [t.reward for t in first.turns] == [1.0, 0.0, 1.0] and first.reward == 2.0
    assert [t.state_hash for t in first.turns] == [100, 101, 102]  # the state each reply was made in
    assert tokenizer.decode(first.turns[0].observation_ids) == "go s1n0>"
    assert tokenizer.decode(first.turns[1].observation_ids) == "n1>"
    assert not first.truncated and not first.failed and first.info["success"]
    batch = episode_batch(episodes, tokenizer.pad_token_id, max_length=512)
    assert tokenizer.decode(batch["responses"][0][batch["action_mask"][0].bool()]) == "a</s>b</s>a</s>"
    assert tokenizer.decode(batch["responses"][0][batch["turn_index"][0] == 1]) == "b</s>"
    print(transcript(first, tokenizer))


def test_a_failing_environment_ends_its_episode_and_the_others_go_on(tiny_model_path):
    tokenizer = load_tokenizer(str(tiny_model_path))
    episodes = play([Explodes(), Counter()], seeds=[1, 2], groups=[0, 0], policy=scripted_policy(["a"], tokenizer),
                    tokenizer=tokenizer)
    broken, fine = episodes
    assert broken.failed and "RuntimeError: the simulator crashed" in broken.info["error"]
    assert len(broken.turns) == 2 and broken.turns[-1].reward == 0.0  # the failing step earns nothing
    assert not fine.failed and len(fine.turns) == 3
    assert "failed: step: RuntimeError" in transcript(broken, tokenizer)


def test_turn_and_length_limits_truncate(tiny_model_path):
    tokenizer = load_tokenizer(str(tiny_model_path))
    (short,) = play([Counter()], [1], [0], scripted_policy(["b"], tokenizer), tokenizer, max_turns=2)
    assert short.truncated and len(short.turns) == 2
    (tight,) = play([Counter()], [1], [0], scripted_policy(["b"], tokenizer), tokenizer, max_length=10)
    # "s1n0>" + "b</s>" = 7 tokens; the reply "n1>" makes 10, leaving no room for another action
    assert tight.truncated and len(tight.turns) == 1


def test_the_policy_saw_exactly_the_ids_that_are_trained(tiny_model_path):
    """The sampler's log-probs of every reply token equal the trainer's on the built row."""
    from roll_core.config import load_config
    from roll_core.strategies.hf import HFInferStrategy, HFTrainStrategy

    cfg = load_config(None, [])
    tokenizer = load_tokenizer(str(tiny_model_path))
    engine = HFInferStrategy(str(tiny_model_path), cfg.roles.actor_infer, seed=0)
    policy = engine_policy(engine.generate, tokenizer.pad_token_id, max_new_tokens=4, temperature=1.0, top_p=1.0)
    episodes = play([Counter(), Counter(), Counter()], [1, 2, 3], [0, 0, 1], policy, tokenizer)
    batch = episode_batch(episodes, tokenizer.pad_token_id, max_length=512)
    trainer = HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
    mask = batch["action_mask"].bool()
    assert int(mask.sum()) > 3 * 3  # several tokens per reply, three replies per episode
    torch.testing.assert_close(trainer.compute_log_probs(batch, 1.0)[mask], batch["infer_log_probs"][mask],
                               atol=1e-4, rtol=0)


def test_a_reset_that_raises_fails_only_that_episode(tiny_model_path):
    class WontStart(Counter):
        def reset(self, seed=None):
            raise ValueError("no such map")

    tokenizer = load_tokenizer(str(tiny_model_path))
    bad, good = play([WontStart(), Counter()], [1, 2], [0, 1], scripted_policy(["a"], tokenizer), tokenizer)
    assert bad.failed and bad.turns == [] and "reset: ValueError: no such map" in bad.info["error"]
    assert len(good.turns) == 3
    with pytest.raises(ValueError, match="an episode without turns .* is not a training row"):
        episode_batch([bad], tokenizer.pad_token_id, max_length=16)  # an episode without turns is not a row


# -- without a model: the teacher, one environment's own loop, stepping in threads, how episodes end --

CHARS = build_char_tokenizer()  # the embedded model's tokenizer, built without the model


class Maze(Counter):
    """Counter with a small action set and an expert who answers 'a' until the third reply; ends
    ``truncated`` by the environment (a time limit) when ``cut`` is set, or both flags at once."""

    actions = ("a", "b", "c")

    def __init__(self, cut=False, both=False):
        self.cut, self.both = cut, both

    def expert_action(self):
        return "a" if self.n < 2 else None

    def step(self, action):
        observation, reward, terminated, _, info = super().step(action)
        if self.both:
            return observation, reward, terminated, terminated, info
        return observation, reward, False if self.cut else terminated, terminated and self.cut, info


def replies(episode, tokenizer):
    return [tokenizer.decode(t.action_ids, skip_special_tokens=True) for t in episode.turns]


def test_the_teacher_follows_the_expert_and_draws_from_the_actions_when_it_has_none_or_errs():
    tokenizer = CHARS
    (careful,) = play([Maze()], [1], [0], teacher_policy(tokenizer, noise=0.0, seed=3), tokenizer)
    first_two = replies(careful, tokenizer)[:2]
    assert first_two == ["a", "a"] and replies(careful, tokenizer)[2] in Maze.actions  # no expert at turn 3
    assert careful.turns[0].action_ids[-1] == tokenizer.eos_token_id and careful.turns[0].action_log_probs == [0.0, 0.0]
    draws = [replies(play([Maze()], [1], [0], teacher_policy(tokenizer, noise=1.0, seed=s), tokenizer)[0], tokenizer)
             for s in range(8)]
    assert {r for d in draws for r in d} == set(Maze.actions)  # every turn a uniform draw, 'b' and 'c' too
    assert draws == [replies(play([Maze()], [1], [0], teacher_policy(tokenizer, noise=1.0, seed=s), tokenizer)[0],
                             tokenizer) for s in range(8)]  # seeded
    with pytest.raises(ValueError, match=r"noise must be in \[0, 1\], got 1.5"):
        teacher_policy(tokenizer, noise=1.5)

    class FreeText(Counter):
        def expert_action(self):
            return None

    with pytest.raises(ValueError, match="FreeText has no expert action here and no 'actions' to draw from"):
        play([FreeText()], [1], [0], teacher_policy(tokenizer), tokenizer)


def test_one_environments_own_loop_plays_what_the_lockstep_loop_plays():
    tokenizer = CHARS
    policy = scripted_policy(["a", "b", "a"], tokenizer)
    (together,) = play([Counter()], [4], [2], policy, tokenizer, max_turns=5)
    alone = play_one(Counter(), 4, 2, lambda conversation, env: policy([conversation], [env])[0],
                     Rules(tokenizer, max_turns=5), label="counter")
    assert alone.env == "counter" and alone.group == together.group == 2
    assert [(t.observation_ids, t.action_ids, t.reward, t.state_hash) for t in alone.turns] == [
        (t.observation_ids, t.action_ids, t.reward, t.state_hash) for t in together.turns]
    assert (alone.truncated, alone.failed, alone.info) == (together.truncated, together.failed, together.info)

    class WontStart(Counter):
        def reset(self, seed=None):
            raise ValueError("no such map")

    broken = play_one(WontStart(), 4, 2, lambda conversation, env: policy([conversation], [env])[0],
                      Rules(tokenizer))
    assert broken.failed and broken.turns == [] and broken.info == {"error": "reset: ValueError: no such map",
                                                                      "hung": False}


def test_environments_stepped_in_threads_play_the_same_episodes():
    tokenizer = CHARS
    policy = scripted_policy(["a", "b"], tokenizer)
    envs = [Counter, Explodes, Counter, Maze]
    serial = play([e() for e in envs], [1, 2, 3, 4], [0, 0, 1, 1], policy, tokenizer)
    threaded = play([e() for e in envs], [1, 2, 3, 4], [0, 0, 1, 1], policy, tokenizer, concurrent_steps=True)
    summary = [[(t.observation_ids, t.action_ids, t.reward) for t in e.turns] + [e.failed, e.truncated]
               for e in serial]
    assert summary == [[(t.observation_ids, t.action_ids, t.reward) for t in e.turns] + [e.failed, e.truncated]
                       for e in threaded]
    assert [e.failed for e in threaded] == [False, True, False, False]


@pytest.mark.parametrize("cut, both, truncated", [(False, False, False), (True, False, True), (False, True, False)])
def test_an_episode_the_environment_ends_is_truncated_only_when_it_says_so_without_terminating(cut, both, truncated):
    tokenizer = CHARS
    (episode,) = play([Maze(cut=cut, both=both)], [1], [0], scripted_policy(["a"], tokenizer), tokenizer)
    assert len(episode.turns) == 3 and episode.truncated is truncated and episode.info == {"success": True}


def test_the_limits_cut_at_exactly_max_turns_and_max_length():
    """Counter ends after 3 replies: max_turns=3 lets the environment end it, 2 cuts it; with
    "s1n0>" (5), "b</s>" (2) and "n1>" (3), 10 tokens cannot hold a next reply, 11 can."""
    tokenizer = CHARS
    policy = scripted_policy(["b"], tokenizer)
    (ended,) = play([Counter()], [1], [0], policy, tokenizer, max_turns=3)
    (cut,) = play([Counter()], [1], [0], policy, tokenizer, max_turns=2)
    assert (len(ended.turns), ended.truncated) == (3, False) and (len(cut.turns), cut.truncated) == (2, True)
    (tight,) = play([Counter()], [1], [0], policy, tokenizer, max_length=10)
    (roomy,) = play([Counter()], [1], [0], policy, tokenizer, max_length=11)
    assert (len(tight.turns), tight.truncated) == (1, True)
    assert len(roomy.turns) == 2 and tokenizer.decode(roomy.turns[1].observation_ids) == "n1>"


def test_engine_policy_left_pads_the_conversations_and_keeps_only_generated_tokens():
    seen = {}

    def generate(batch, **sampling):
        seen.update(ids=batch["prompt_ids"].tolist(), mask=batch["prompt_mask"].tolist(), sampling=sampling)
        return {"responses": torch.tensor([[7, 8, 0], [9, 0, 0]]),
                "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
                "infer_log_probs": torch.tensor([[-0.5, -0.25, 0.0], [-1.0, 0.0, 0.0]])}

    policy = engine_policy(generate, pad_token_id=0, max_new_tokens=3, temperature=0.5)
    assert policy([[5, 6, 7], [4]]) == [([7, 8], [-0.5, -0.25]), ([9], [-1.0])]
    assert seen == {"ids": [[5, 6, 7], [0, 0, 4]], "mask": [[1, 1, 1], [0, 0, 1]],
                    "sampling": {"max_new_tokens": 3, "temperature": 0.5}}


def test_an_env_workers_failure_and_hang_are_reported_as_they_come():
    """An environment on an env worker fails with the worker's own message (it names the environment
    already); one that hung is flagged, so the metrics count it apart; a reply without ``success``
    is no success."""

    class Remote(Counter):
        def __init__(self, error=None):
            self.error = error

        def step(self, action):
            if self.error is not None:
                raise self.error
            return "n1", 0.5, True, False, {}

    tokenizer = CHARS
    failed, hung, plain = play([Remote(EnvFailed("maze: step raised KeyError 'x'")),
                                Remote(EnvHung("maze: no answer in 5 s; replaced")), Remote()],
                               [1, 2, 3], [0, 1, 2], scripted_policy(["a"], tokenizer), tokenizer)
    assert failed.info == {"error": "maze: step raised KeyError 'x'", "hung": False}
    assert hung.info == {"error": "maze: no answer in 5 s; replaced", "hung": True}
    assert plain.info == {"success": False} and plain.reward == 0.5


def test_with_concurrent_steps_a_turns_environments_step_at_once():
    """Each step waits at a barrier for all three: stepped one after the other, the first would wait
    for the others forever (here: fail after 5 s)."""
    barrier = threading.Barrier(3, timeout=5)

    class Together(Counter):
        def step(self, action):
            barrier.wait()
            return super().step(action)

    tokenizer = CHARS
    episodes = play([Together() for _ in range(3)], [1, 2, 3], [0, 0, 0], scripted_policy(["a"], tokenizer),
                    tokenizer, concurrent_steps=True)
    assert [(len(e.turns), e.failed) for e in episodes] == [(3, False)] * 3
