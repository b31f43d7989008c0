"""Agentic environments whose observations carry images (:class:`roll_core.envs.Observation`):
each turn's images through the model's processor, conversations and training rows that hold a
different number of images per sample (``image_counts``), the trainer's passes over image tokens
in the response (the environment's replies), and the run's checks before any worker starts.
roll-envs' pictures of its grids are tested in its own ``tests/test_pictures.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roll_core.agentic.episodes import Rules, TurnFormat, play, scripted_policy
from roll_core.agentic.samples import episode_batch
from roll_core.envs import Env, Observation, observation_parts
from roll_core.errors import ConfigError
from roll_core.multimodal import IMAGE_COUNTS, IMAGES, encode_text, model_images, stack_images

frozen_lake = pytest.importorskip("roll_envs.frozen_lake")


def test_an_observation_is_text_or_text_with_images():
    assert observation_parts("map") == ("map", [])
    assert observation_parts(Observation("<image>x<image>", [1, 2])) == ("<image>x<image>", [1, 2])
    with pytest.raises(TypeError, match="a str or a roll_core.envs.Observation, got dict"):
        observation_parts({"text": "x"})


def test_an_observation_s_images_become_their_image_tokens_and_pixels(tiny_vlm_tokenizer):
    image_id = tiny_vlm_tokenizer.convert_tokens_to_ids("<image>")
    ids, pixels = encode_text(tiny_vlm_tokenizer, "<image>:ab", [np.full((16, 16, 3), 255, np.uint8)])
    assert ids[:16] == [image_id] * 16 and tiny_vlm_tokenizer.decode(ids[16:]) == ":ab"
    torch.testing.assert_close(pixels, torch.ones(1, 3, 16, 16))
    plain = tiny_vlm_tokenizer("ab", add_special_tokens=False)["input_ids"]
    assert encode_text(tiny_vlm_tokenizer, "ab", []) == (plain, None)
    with pytest.raises(ValueError, match=r"1 image\(s\) and 2 '<image>' placeholder\(s\)"):
        encode_text(tiny_vlm_tokenizer, "<image><image>", [np.zeros((16, 16, 3), np.uint8)])


def test_samples_with_different_numbers_of_images_pad_and_count_them():
    a, b = torch.full((2, 3, 4, 4), 1.0), torch.full((1, 3, 4, 4), 2.0)
    a[1] = 3.0
    out = stack_images([a, None, b])
    assert out[IMAGES].shape == (3, 2, 3, 4, 4) and out[IMAGE_COUNTS].tolist() == [2, 0, 1]
    assert out[IMAGES][1].abs().sum() == 0 and out[IMAGES][2, 1].abs().sum() == 0
    flat = model_images(out[IMAGES], counts=out[IMAGE_COUNTS])[IMAGES]
    assert flat[:, 0, 0, 0].tolist() == [1.0, 3.0, 2.0]  # the real ones, sample by sample, in order
    assert model_images(out[IMAGES])[IMAGES].shape[0] == 6  # without counts: every slot
    assert stack_images([None, None]) == {}


class _Pictures(Env):
    """Each observation an image whose pixels are the turn number, so the tests can tell turns apart."""

    image_observations = True
    actions = ("a",)

    def reset(self, seed=None):
        self.turn = 0
        return Observation("<image>s", [np.full((16, 16, 3), 10, np.uint8)]), {}

    def step(self, action):
        self.turn += 1
        return Observation("<image>", [np.full((16, 16, 3), 10 + 40 * self.turn, np.uint8)]), 0.5, self.turn == 3, \
            False, {}


def test_each_turn_the_policy_sees_every_image_so_far_and_the_row_keeps_them_all(tiny_vlm_tokenizer):
    seen = []
    script = scripted_policy(["a"], tiny_vlm_tokenizer)

    def policy(conversations, envs, images=None):
        seen.append([None if i is None else len(i) for i in images])
        return script(conversations, envs)

    episodes = play([_Pictures(), _Pictures()], [0, 1], [0, 0], policy, tiny_vlm_tokenizer, max_turns=2)
    assert seen == [[1, 1], [2, 2]]  # the second turn's conversation: the first image, then the reply's
    seen.clear()
    play([_Pictures(), frozen_lake.FrozenLake()], [0, 1], [0, 1], policy, tiny_vlm_tokenizer, max_turns=2)
    assert seen == [[1, None], [2, None]]  # a text environment's conversations beside them have none
    assert [len(e.turns) for e in episodes] == [2, 2] and episodes[0].truncated
    batch = episode_batch(episodes, tiny_vlm_tokenizer.pad_token_id, 256)
    assert batch[IMAGE_COUNTS].tolist() == [2, 2]
    image_id = tiny_vlm_tokenizer.convert_tokens_to_ids("<image>")
    assert (batch["prompt_ids"] == image_id).sum(-1).tolist() == [16, 16]
    assert (batch["responses"] == image_id).sum(-1).tolist() == [16, 16]  # the reply's image, in the response
    assert (batch["action_mask"].bool() & (batch["responses"] == image_id)).sum() == 0
    level = batch[IMAGES][0, :, 0, 0, 0]
    torch.testing.assert_close(level, torch.tensor([10, 50]) / 127.5 - 1)  # in turn order
    from roll_core.agentic.episodes import transcript

    assert transcript(episodes[0], tiny_vlm_tokenizer).startswith("[turn 0] <image>s>\n  reply: 'a'   reward 0.5\n"
                                                         "[turn 1] <image>>\n")
    from roll_core.pipelines.rollout_dump import readable_rows

    row = readable_rows(batch, tiny_vlm_tokenizer)[0]  # a rollout dump's text: each image once
    assert row["prompt"] == "<image>s>" and row["turns"][1] == {"role": "environment", "text": "<image>>"}
    cut = episode_batch(episodes, tiny_vlm_tokenizer.pad_token_id, episodes[0].turns[0].length)  # the first turn fits
    assert cut[IMAGE_COUNTS].tolist() == [1, 1] and cut[IMAGES].shape[1] == 1


def test_an_observation_whose_images_and_placeholders_differ_fails_its_episode_only(tiny_vlm_tokenizer):
    class Broken(_Pictures):
        def step(self, action):
            return Observation("no placeholder", [np.zeros((16, 16, 3), np.uint8)]), 0.0, False, False, {}

    class BrokenAtReset(_Pictures):
        def reset(self, seed=None):
            return Observation("<image><image>", [np.zeros((16, 16, 3), np.uint8)]), {}

    script = scripted_policy(["a"], tiny_vlm_tokenizer)
    episodes = play([Broken(), BrokenAtReset(), _Pictures()], [0, 1, 2], [0, 1, 2], script, tiny_vlm_tokenizer)
    assert episodes[0].failed and "placeholder" in episodes[0].info["error"]
    assert episodes[1].failed and not episodes[1].turns and "2 '<image>' placeholder" in episodes[1].info["error"]
    assert not episodes[2].failed and len(episodes[2].turns) == 3


def test_environment_level_asynchronous_rollout_sends_each_conversation_s_images(tiny_vlm_tokenizer):
    from roll_core.agentic.async_rollout import RequestBatcher
    from roll_core.agentic.episodes import play_one

    script, calls = scripted_policy(["a"], tiny_vlm_tokenizer), []

    def policy(conversations, envs, images=None):
        calls.append(None if images is None else [None if i is None else len(i) for i in images])
        return script(conversations, envs)

    ask = RequestBatcher(policy)
    try:
        rules = Rules(tiny_vlm_tokenizer, TurnFormat(), max_turns=2)
        episode = play_one(_Pictures(), 0, 0, ask, rules)
        text = play_one(frozen_lake.FrozenLake(), 0, 0, ask, rules)
    finally:
        ask.close()
    assert calls == [[1], [2], None, None] and len(episode.turns) == 2 and len(text.turns) == 2


def _agentic_image_batch(tiny_vlm_tokenizer):
    """Two episodes of different lengths (1 and 3 images) with sampled-looking actions."""
    script = scripted_policy(["a"], tiny_vlm_tokenizer)
    short = play([_Pictures()], [0], [0], script, tiny_vlm_tokenizer, max_turns=1)
    long = play([_Pictures()], [1], [1], script, tiny_vlm_tokenizer)
    return episode_batch(short + long, tiny_vlm_tokenizer.pad_token_id, 256)


def _own_log_probs(tiny_vlm, batch) -> torch.Tensor:
    """Each sample alone through the model's own forward with its own images, on its action tokens."""
    out = torch.zeros(batch["responses"].shape)
    for b in range(len(batch)):
        prompt = batch["prompt_ids"][b][batch["prompt_mask"][b].bool()]
        response = batch["responses"][b][batch["response_mask"][b].bool()]
        ids = torch.cat([prompt, response])[None]
        with torch.no_grad():
            logits = tiny_vlm(input_ids=ids, pixel_values=batch[IMAGES][b, :batch[IMAGE_COUNTS][b]]).logits[0].float()
        logits[:, tiny_vlm.config.image_token_id] = float("-inf")
        logp = logits[len(prompt) - 1:-1].log_softmax(-1).gather(-1, response[:, None])[:, 0]
        out[b, :len(response)] = logp
    return torch.where(batch["action_mask"].bool(), out, 0.0)  # -inf on the reply's image tokens


def test_the_trainer_reads_each_episode_s_images_and_gives_image_tokens_no_log_prob(tiny_vlm_path, tiny_vlm,
                                                                                    tiny_vlm_tokenizer):
    from roll_core.config import load_config
    from roll_core.strategies.hf import HFTrainStrategy

    batch = _agentic_image_batch(tiny_vlm_tokenizer)
    assert batch[IMAGE_COUNTS].tolist() == [1, 3]
    trainer = HFTrainStrategy(str(tiny_vlm_path), load_config(None, ["executor=local"]).roles.actor_train, seed=0)
    got = trainer.compute_log_probs(batch, 1.0)
    torch.testing.assert_close(got * batch["action_mask"], _own_log_probs(tiny_vlm, batch), atol=2e-5, rtol=0)
    image_id = tiny_vlm.config.image_token_id
    assert got[batch["responses"] == image_id].abs().max() == 0  # context, as padding: no -1e9 to overflow
    assert bool(got.isfinite().all()) and got[batch["action_mask"].bool()].lt(0).all()
    # packing is off for such batches unless asked for, and asking is an error
    packed = HFTrainStrategy(str(tiny_vlm_path), load_config(
        None, ["executor=local", "roles.actor_train.pack_sequences=true"]).roles.actor_train, seed=0)
    with pytest.raises(ValueError, match="responses hold images .* Set pack_sequences: false"):
        packed.compute_log_probs(batch, 1.0)


def test_the_engine_samples_each_conversation_with_its_own_images(tiny_vlm_path, tiny_vlm, tiny_vlm_tokenizer):
    from roll_core.agentic.episodes import engine_policy
    from roll_core.config import load_config
    from roll_core.strategies.hf import HFInferStrategy

    engine = HFInferStrategy(str(tiny_vlm_path), load_config(None, ["executor=local"]).roles.actor_infer, seed=0)
    batch = _agentic_image_batch(tiny_vlm_tokenizer)
    prompts = [p[m.bool()] for p, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    responses, turns = batch["responses"], batch["turn_index"]
    short = torch.cat([prompts[0], responses[0][turns[0] == 0]]).tolist()  # one image, then the first action
    second = int((turns[1] == 1).nonzero()[0])  # the long episode up to its second action: two images
    conversations = [short, torch.cat([prompts[1], responses[1][:second]]).tolist(), short]  # 1 and 3 share a prefill
    images = [batch[IMAGES][0, :1], batch[IMAGES][1, :2], batch[IMAGES][0, :1]]
    replies = engine_policy(engine.generate, tiny_vlm_tokenizer.pad_token_id, max_new_tokens=1, temperature=1.0,
                            top_p=1.0)(conversations, None, images=images)
    for conversation, pixels, (action, logp) in zip(conversations, images, replies):
        with torch.no_grad():
            logits = tiny_vlm(input_ids=torch.tensor([conversation]), pixel_values=pixels).logits[0, -1].float()
        logits[tiny_vlm.config.image_token_id] = float("-inf")
        torch.testing.assert_close(torch.tensor(logp[0]), logits.log_softmax(-1)[action[0]], atol=2e-5, rtol=0)


def test_an_image_environment_needs_an_image_model_and_strategies_that_read_images(tmp_path, plain_train_strategy):
    from roll_core.config.loader import load_and_check
    from roll_core.pipelines.agentic import AgenticPipeline
    from roll_core.runtime.executor import LocalExecutor

    base = ["pipeline=agentic", "executor=local", f"output_dir={tmp_path}", "agentic.env=frozen_lake",
            "agentic.env_options={observation: image}", "warmup.steps=0"]
    cfg = load_and_check(None, base + ["roles.actor_train.strategy=plain"], plain_train_strategy)
    pipeline = AgenticPipeline(cfg, LocalExecutor())
    pipeline.plugins = plain_train_strategy
    with pytest.raises(ConfigError, match=r"train strategy 'plain' does not read images \(environment "
                                          r"'frozen_lake' shows them\)"):
        pipeline.prepare()
    text_model = AgenticPipeline(load_and_check(None, base), LocalExecutor())  # the tiny text model
    with pytest.raises(ConfigError, match="has no processor that reads them|has no image processor"):
        text_model.prepare()


def test_agentic_rl_on_frozen_lake_pictures_runs_and_its_engine_and_trainer_agree(tmp_path):
    """``examples/agentic_vlm.yaml`` in this process, cut to a short warm-up and two RL steps: the
    episodes' images go to the engine and the trainer, the sampled log-probs are the trainer's."""
    import json
    from pathlib import Path

    from roll_core.config import load_config
    from roll_core.pipelines.agentic import AgenticPipeline
    from roll_core.runtime.executor import LocalExecutor

    example = Path(__file__).resolve().parents[1] / "examples" / "agentic_vlm.yaml"
    cfg = load_config(example, ["executor=local", f"output_dir={tmp_path}", "trainer.max_steps=2",
                                "trainer.eval_every=0", "trainer.save_every=0", "trackers=[jsonl]",
                                "warmup.steps=4", "agentic.groups_per_step=2", "agentic.group_size=4",
                                "agentic.validation_episodes=8"])
    AgenticPipeline(cfg, LocalExecutor()).run()
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "train/infer_log_prob_gap" in s]
    assert len(trained) == 2 and all(s["train/infer_log_prob_gap"] < 1e-4 for s in trained), trained
    assert all(np.isfinite(s["train/pg_loss"]) for s in trained), trained
