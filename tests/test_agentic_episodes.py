"""The multi-turn loop: episodes played against a policy become the rows the trainer sees, token
for token; a failing environment ends its episode only; long conversations are cut."""

from __future__ import annotations

import pytest
import torch

from roll_core.agentic.episodes import TurnFormat, engine_policy, play, scripted_policy, transcript
from roll_core.agentic.samples import episode_batch
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
