"""Image prompts (:mod:`roll_core.multimodal`): rows to model inputs, the embedded image-reading model
and its task, every pass over an image prompt (prefill, padded, packed, sharded) against the model's
own forward, responses that never hold the image token, and the checks that refuse image data
before any worker starts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from roll_core.errors import ConfigError, RollError
from roll_core.multimodal import (IMAGE_COUNTS, IMAGES, check_rows, encode_prompts, image_keys, load_image,
                                  model_images, processor_for)


@pytest.fixture
def tokenizer(tiny_vlm_tokenizer):
    return tiny_vlm_tokenizer


@pytest.fixture
def model(tiny_vlm):
    return tiny_vlm


def _image(value: int) -> np.ndarray:
    return np.full((16, 16, 3), value, dtype=np.uint8)


def test_the_tiny_vlm_is_a_llava_model_with_its_processor(tiny_vlm_path, model, tokenizer):
    processor = processor_for(str(tiny_vlm_path))
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids("<image>") == processor.image_token_id
    assert model.config.image_seq_length == 16  # (16 / 4) ** 2 patches
    assert model.config.text_config.vocab_size == len(tokenizer)


def test_an_image_prompt_holds_one_token_per_patch_and_its_pixels_scaled_to_plus_minus_one(tokenizer):
    rows = [{"prompt": "<image>color:", "images": [_image(255)]}, {"prompt": "<image>c", "images": [_image(0)]}]
    out = encode_prompts(tokenizer, rows)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert (out["prompt_ids"] == image_id).sum(-1).tolist() == [16, 16]
    assert out["prompt_mask"].sum(-1).tolist() == [16 + 6, 16 + 1]  # left padded, text verbatim
    assert out["prompt_ids"][1, :5].tolist() == [tokenizer.pad_token_id] * 5
    assert out[IMAGES].shape == (2, 1, 3, 16, 16)
    torch.testing.assert_close(out[IMAGES][0], torch.ones(1, 3, 16, 16))  # (255 / 255 - 0.5) / 0.5
    torch.testing.assert_close(out[IMAGES][1], -torch.ones(1, 3, 16, 16))


def test_several_images_per_prompt_stay_with_their_sample_in_order(tokenizer):
    rows = [{"prompt": "<image>a<image>", "images": [_image(255), _image(0)]},
            {"prompt": "<image><image>b", "images": [_image(0), _image(255)]}]
    out = encode_prompts(tokenizer, rows)
    assert out[IMAGES].shape == (2, 2, 3, 16, 16)
    assert out[IMAGES][:, :, 0, 0, 0].tolist() == [[1.0, -1.0], [-1.0, 1.0]]
    assert (out["prompt_ids"] == tokenizer.convert_tokens_to_ids("<image>")).sum(-1).tolist() == [32, 32]
    flat = model_images(out[IMAGES])[IMAGES]  # the model's order: sample by sample, each one's in order
    assert flat.shape == (4, 3, 16, 16) and flat[:, 0, 0, 0].tolist() == [1.0, -1.0, -1.0, 1.0]


def test_a_group_repeats_its_prompt_with_its_images_and_the_warm_up_pads_them(tokenizer):
    from roll_core.pipelines.batches import demonstration_batch, packed_demonstration_batch
    from roll_core.rollout.sync import expand_rows

    rows = [{"prompt": "<image>c:", "images": [_image(255)], "ground_truth": "red", "demonstration": "red"},
            {"prompt": "<image>c:", "images": [_image(0)], "ground_truth": "blue", "demonstration": "blue"}]
    batch = expand_rows(tokenizer, rows, 3)
    assert batch[IMAGES].shape == (6, 1, 3, 16, 16)
    assert batch[IMAGES][:, 0, 0, 0, 0].tolist() == [1.0] * 3 + [-1.0] * 3
    assert batch["ground_truth"] == ["red"] * 3 + ["blue"] * 3
    supervised = demonstration_batch(tokenizer, rows)
    assert supervised[IMAGES][:, 0, 0, 0, 0].tolist() == [1.0, -1.0]
    with pytest.raises(ConfigError, match="warmup.packing does not take rows with images"):
        packed_demonstration_batch(tokenizer, rows, max_length=64)


def test_text_rows_encode_as_plain_prompts(tokenizer):
    out = encode_prompts(tokenizer, [{"prompt": "12+3="}, {"prompt": "4="}])
    assert set(out) == {"prompt_ids", "prompt_mask"}
    assert out["prompt_mask"].tolist() == [[1] * 5, [0, 0, 0, 1, 1]]


def test_images_are_read_from_files_arrays_and_pil_images(tmp_path):
    from PIL import Image

    array = np.arange(48, dtype=np.uint8).reshape(4, 4, 3)
    Image.fromarray(array).save(tmp_path / "a.png")
    Image.fromarray(array).convert("L").save(tmp_path / "grey.png")
    for given in (str(tmp_path / "a.png"), array, Image.fromarray(array).convert("RGBA"), str(tmp_path / "grey.png")):
        image = load_image(given)
        assert image.mode == "RGB" and image.size == (4, 4)
    assert np.array_equal(np.asarray(load_image(str(tmp_path / "a.png"))), array)
    for wrong in (np.zeros((4, 4), dtype=np.uint8), np.zeros((4, 4, 4), dtype=np.uint8), np.zeros((4, 4, 3))):
        with pytest.raises(ConfigError, match=r"\[H, W, 3\] uint8"):
            load_image(wrong)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_image(str(tmp_path / "missing.png"))


def test_a_jsonl_file_names_images_relative_to_itself(tmp_path):
    from roll_core.data import read_jsonl

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.jsonl").write_text(json.dumps({"prompt": "<image>x", "images": ["img/1.png"]}) + "\n"
                                                 + json.dumps({"prompt": "y", "images": ["/abs/2.png"]}) + "\n")
    rows = read_jsonl(tmp_path / "data" / "rows.jsonl")
    assert rows[0]["images"] == [str(tmp_path / "data" / "img" / "1.png")]
    assert rows[1]["images"] == ["/abs/2.png"]


def test_rows_need_a_placeholder_per_image_and_may_hold_other_numbers_of_them():
    check_rows([{"prompt": "<image><image>q", "images": [1, 2]}, {"prompt": "<image>q", "images": [1]},
                {"prompt": "q"}], "training")
    with pytest.raises(ConfigError, match="training row 0 has 2 image.*1 '<image>' placeholder"):
        check_rows([{"prompt": "<image>q", "images": [1, 2]}], "training")
    with pytest.raises(ConfigError, match="held-out row 1 has 0 image.*1 '<image>' placeholder"):
        check_rows([{"prompt": "q"}, {"prompt": "<image>q"}], "held-out")


MIXED = [{"prompt": "a:"}, {"prompt": "<image>b<image>", "images": [_image(255), _image(0)]},
         {"prompt": "<image>c", "images": [_image(0)]}]


def test_rows_of_other_image_counts_encode_with_their_counts_and_only_their_own_images(tokenizer):
    out = encode_prompts(tokenizer, MIXED)
    assert out[IMAGES].shape == (3, 2, 3, 16, 16) and out[IMAGE_COUNTS].tolist() == [0, 2, 1]
    assert out[IMAGES][:, :, 0, 0, 0].tolist() == [[0.0, 0.0], [1.0, -1.0], [-1.0, 0.0]]  # zeros past each one's
    assert (out["prompt_ids"] == tokenizer.convert_tokens_to_ids("<image>")).sum(-1).tolist() == [0, 32, 16]
    flat = model_images(out[IMAGES], counts=out[IMAGE_COUNTS])[IMAGES]  # the image tokens' order, no padding
    assert flat[:, 0, 0, 0].tolist() == [1.0, -1.0, -1.0]
    assert model_images(out[IMAGES][:1], counts=out[IMAGE_COUNTS][:1]) == {}  # a text sample alone: no images


def test_parts_with_other_numbers_of_images_or_none_concatenate(tokenizer):
    from roll_core.data import Batch

    parts = [Batch(encode_prompts(tokenizer, rows)) for rows in ([MIXED[0]], [MIXED[2]], MIXED[1:])]
    whole = Batch.concat(parts)  # a text part (no image fields), a one-image part, a part of 2 and 1 images
    assert whole[IMAGES].shape == (4, 2, 3, 16, 16) and whole[IMAGE_COUNTS].tolist() == [0, 1, 2, 1]
    assert whole[IMAGES][:, :, 0, 0, 0].tolist() == [[0.0, 0.0], [-1.0, 0.0], [1.0, -1.0], [-1.0, 0.0]]
    uncounted = Batch({k: v for k, v in parts[1].tensors.items() if k != IMAGE_COUNTS})  # an older batch's
    assert Batch.concat([parts[0], uncounted])[IMAGE_COUNTS].tolist() == [0, 1]  # its images all real
    # prompts of other widths, left-padded to the widest: each still ends where its response starts
    assert whole["prompt_ids"].shape[1] == max(p["prompt_ids"].shape[1] for p in parts)
    assert bool(whole["prompt_mask"][:, -1].all()) and whole["prompt_mask"].sum(-1).tolist() == [
        int(p["prompt_mask"][i].sum()) for p in parts for i in range(len(p))]


def test_a_model_without_an_image_processor_is_refused_by_path(tiny_model_path, tokenizer):
    from roll_core.pipelines.runtime import load_tokenizer

    text_only = load_tokenizer(str(tiny_model_path))
    with pytest.raises(ConfigError, match=f"the model at {tiny_model_path} has no"):
        encode_prompts(text_only, [{"prompt": "<image>q", "images": [_image(3)]}])


def test_a_processor_with_more_image_inputs_is_refused_by_name(tokenizer, monkeypatch):
    import roll_core.multimodal as multimodal

    class QwenLike:
        image_token = "<|image_pad|>"
        text: list[str] = []

        def __call__(self, text, **kwargs):
            self.text += text
            return {"input_ids": torch.zeros(1, 2), "attention_mask": torch.ones(1, 2),
                    IMAGES: torch.zeros(4, 8), "image_grid_thw": torch.ones(1, 3)}

    processor = QwenLike()
    monkeypatch.setattr(multimodal, "processor_for", lambda path: processor)
    with pytest.raises(ConfigError, match=r"\(image_grid_thw\)"):
        encode_prompts(tokenizer, [{"prompt": "<image>q<image>", "images": [_image(3), _image(4)]}])
    assert processor.text == ["<|image_pad|>q<|image_pad|>"]  # the model's own image token in the placeholders' place


def test_image_keys_are_equal_exactly_for_equal_images():
    images = torch.stack([torch.zeros(1, 3, 2, 2), torch.ones(1, 3, 2, 2), torch.zeros(1, 3, 2, 2)])
    keys = image_keys(images)
    assert keys[0] == keys[2] != keys[1]
    assert model_images(None) == {}
    assert model_images(images)[IMAGES].shape == (3, 3, 2, 2)


def test_color_shapes_teacher_confuses_only_orange_and_purple():
    from roll_core.embedded.tasks import CONFUSED, ColorShapesConfig, ColorShapesTask

    task = ColorShapesTask(ColorShapesConfig(num_train=600, num_eval=50, teacher_confusion=0.75))
    train, held_out = task.train_rows(), task.eval_rows()
    assert len(train) == 600 and len(held_out) == 50
    assert all("demonstration" not in r for r in held_out)
    wrong = [r for r in train if r["demonstration"] != r["ground_truth"]]
    assert wrong and {r["ground_truth"] for r in wrong} == set(CONFUSED)
    assert all(r["demonstration"] == CONFUSED[r["ground_truth"]] for r in wrong)
    confusable = [r for r in train if r["ground_truth"] in CONFUSED]
    assert 0.65 < len(wrong) / len(confusable) < 0.85
    # the held-out images are drawn after the training ones, not among them
    assert not any(np.array_equal(h["images"][0], t["images"][0]) for h, t in zip(held_out, train))
    image = train[0]["images"][0]
    assert image.shape == (16, 16, 3) and image.dtype == np.uint8 and 0 < (image.sum(-1) > 0).mean() < 1
    again = ColorShapesTask(ColorShapesConfig(num_train=600, num_eval=50, teacher_confusion=0.75)).train_rows()
    assert all(np.array_equal(a["images"][0], b["images"][0]) for a, b in zip(train, again))  # from the seed alone


def _model_log_probs(model, batch) -> torch.Tensor:
    """Each sample alone through the model's own forward: the log-probs of its response tokens under
    the distribution without the image token, which no response holds."""
    out = []
    for b in range(len(batch)):
        prompt = batch["prompt_ids"][b][batch["prompt_mask"][b].bool()]
        ids = torch.cat([prompt, batch["responses"][b]])[None]
        n = int(batch[IMAGE_COUNTS][b]) if IMAGE_COUNTS in batch else batch[IMAGES].shape[1]
        with torch.no_grad():
            logits = model(input_ids=ids, **({"pixel_values": batch[IMAGES][b][:n]} if n else {})).logits[0].float()
        logits[:, model.config.image_token_id] = float("-inf")
        r = batch["responses"].shape[1]
        logp = logits[len(prompt) - 1:-1].log_softmax(-1).gather(-1, batch["responses"][b][:, None])[:, 0]
        out.append(logp[:r])
    return torch.stack(out) * batch["response_mask"]


@pytest.mark.parametrize("packed", [True, False])
def test_the_passes_give_each_sample_the_log_probs_of_its_own_images(tiny_vlm_path, model, packed):
    from roll_core.config import load_config
    from roll_core.strategies.hf import HFTrainStrategy
    from roll_core.testing import image_training_batch

    cfg = load_config(None, ["executor=local", f"roles.actor_train.pack_sequences={str(packed).lower()}"])
    trainer = HFTrainStrategy(str(tiny_vlm_path), cfg.roles.actor_train, seed=0)
    batch = image_training_batch(tiny_vlm_path)
    got = trainer.compute_log_probs(batch, 1.0)
    torch.testing.assert_close(got, _model_log_probs(model, batch), atol=2e-5, rtol=0)
    assert bool(trainer.forward(batch, ("entropy",), 1.0)["entropy"].isfinite().all())  # 0 log 0 for the image token
    blind = batch.select(list(range(len(batch))))
    del blind.tensors[IMAGES]  # a batch built without its images: an error, not image tokens read as text
    with pytest.raises(RollError, match="hold the model's image token .* no 'pixel_values'"):
        trainer.compute_log_probs(blind, 1.0)
    # samples 4 and 5: the same text over different images, so different log-probs
    assert not torch.allclose(got[4] * batch["response_mask"][5], got[5] * batch["response_mask"][4])


def _mixed_batch(model_path):
    """:func:`training_batch`'s fields over text prompts and prompts of one and of two images."""
    from roll_core.embedded.tasks import ColorShapesTask
    from roll_core.pipelines.runtime import load_tokenizer
    from roll_core.testing import training_batch

    tokenizer = load_tokenizer(str(model_path))
    one = ColorShapesTask().eval_rows()
    two = {"prompt": one[1]["prompt"] + one[2]["prompt"], "images": one[1]["images"] + one[2]["images"]}
    rows = [{"prompt": "colour:"}] * 2 + [two] * 2 + [one[3]] * 2 + [{"prompt": "shape?"}, one[4]]
    return training_batch(tokenizer.convert_tokens_to_ids("<image>")).update(**encode_prompts(tokenizer, rows))


def test_a_dump_shows_every_image_of_a_prompt_adjacent_ones_too(tiny_vlm_path):
    """Two images with nothing between them are one run of image tokens; a dump's text shows each."""
    from roll_core.embedded.tasks import ColorShapesTask
    from roll_core.multimodal import readable
    from roll_core.pipelines.rollout_dump import readable_rows
    from roll_core.pipelines.runtime import load_tokenizer
    from roll_core.testing import training_batch

    tokenizer = load_tokenizer(str(tiny_vlm_path))
    image = ColorShapesTask().eval_rows()[0]["images"][0]
    rows = [{"prompt": "<image><image>same?", "images": [image] * 2}, {"prompt": "<image>a<image><image>",
                                                                        "images": [image] * 3},
            {"prompt": "colour:"}, {"prompt": "<image>", "images": [image]}] * 2
    batch = training_batch(tokenizer.convert_tokens_to_ids("<image>")).update(**encode_prompts(tokenizer, rows))
    shown = [row["prompt"] for row in readable_rows(batch, tokenizer)]
    assert shown == ["<image><image>same?", "<image>a<image><image>", "colour:", "<image>"] * 2
    first = batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist()
    assert readable(tokenizer, first) == "<image>same?"  # without each image's token count: one per run


@pytest.mark.parametrize("packed", [True, False])
def test_text_prompts_and_prompts_of_other_image_counts_mix_in_every_pass(tiny_vlm_path, model, packed):
    """Each sample gets the log-probs of its own images (none for a text prompt), packed or padded,
    in micro-batches of text prompts alone too; the prefill shares a prompt only with its group."""
    from roll_core.config import load_config
    from roll_core.strategies.hf import HFTrainStrategy
    from roll_core.strategies.sequences import prefill

    batch = _mixed_batch(tiny_vlm_path)
    assert batch[IMAGE_COUNTS].tolist() == [0, 0, 2, 2, 1, 1, 0, 1]
    cfg = load_config(None, ["executor=local", f"roles.actor_train.pack_sequences={str(packed).lower()}"])
    trainer = HFTrainStrategy(str(tiny_vlm_path), cfg.roles.actor_train, seed=0)
    expected = _model_log_probs(model, batch)
    torch.testing.assert_close(trainer.compute_log_probs(batch, 1.0), expected, atol=2e-5, rtol=0)
    text_only = batch.select([0, 1, 6])
    torch.testing.assert_close(trainer.compute_log_probs(text_only, 1.0), expected[[0, 1, 6]], atol=2e-5, rtol=0)
    ids, mask = batch["prompt_ids"], batch["prompt_mask"]
    with torch.no_grad():
        _, logits = prefill(model, ids, mask, images=batch[IMAGES], image_counts=batch[IMAGE_COUNTS])
        for b in range(len(batch)):
            n = int(batch[IMAGE_COUNTS][b])
            alone = model(input_ids=ids[b][mask[b].bool()][None],
                          **({"pixel_values": batch[IMAGES][b][:n]} if n else {})).logits[0, -1]
            torch.testing.assert_close(logits[b], alone.float(), atol=2e-5, rtol=0)


def test_a_shared_prefill_is_shared_only_by_prompts_with_the_same_images(model, tiny_vlm_path):
    from roll_core.strategies.sequences import prefill
    from roll_core.testing import image_training_batch

    batch = image_training_batch(tiny_vlm_path)
    ids, mask, images = batch["prompt_ids"], batch["prompt_mask"], batch[IMAGES]
    with torch.no_grad():
        _, logits = prefill(model, ids, mask, images=images)
        for b in range(len(batch)):
            alone = model(input_ids=ids[b][mask[b].bool()][None], pixel_values=images[b]).logits[0, -1]
            torch.testing.assert_close(logits[b], alone.float(), atol=2e-5, rtol=0)


def test_responses_never_hold_the_image_token_and_their_log_probs_leave_it_out(model, tiny_vlm_path):
    from roll_core.strategies.sequences import never_drawn, sample_responses
    from roll_core.testing import image_training_batch

    batch = image_training_batch(tiny_vlm_path)
    image_id = model.config.image_token_id
    assert never_drawn(model.config) == [image_id] and never_drawn(model.config.text_config) == []
    def image_token_wins(module, args, output):  # without the ban, every draw would be the image token
        output.logits[..., image_id] = output.logits.max() + 50.0

    hook = model.register_forward_hook(image_token_wins)
    try:
        tokens, _, logp = sample_responses(model, batch["prompt_ids"], batch["prompt_mask"], images=batch[IMAGES],
                                           never=[image_id], max_new_tokens=4, eos_token_id=None, pad_token_id=0,
                                           temperature=1.0, generator=torch.Generator().manual_seed(0))
        assert not bool((tokens == image_id).any())
        with torch.no_grad():
            first = model(input_ids=batch["prompt_ids"][:1][batch["prompt_mask"][:1].bool()][None],
                          pixel_values=batch[IMAGES][0]).logits[0, -1].float()
        first[image_id] = float("-inf")
        torch.testing.assert_close(logp[0, 0], first.log_softmax(-1)[tokens[0, 0]], atol=1e-5, rtol=0)
        # the trainer's log-probs of those samples are the sampler's: the same distribution, without the image token
        from roll_core.config import load_config
        from roll_core.strategies.hf import HFTrainStrategy

        trainer = HFTrainStrategy(str(tiny_vlm_path), load_config(None, []).roles.actor_train, seed=0)
        trainer.model.load_state_dict(model.state_dict())
        sampled = batch.select(list(range(len(batch))))
        sampled.update(responses=tokens, response_mask=torch.ones_like(tokens))
        torch.testing.assert_close(trainer.compute_log_probs(sampled, 1.0), logp, atol=2e-5, rtol=0)
    finally:
        hook.remove()


def test_image_data_needs_strategies_that_read_images(tmp_path, plain_train_strategy):
    from roll_core.config.loader import load_and_check

    plugins = plain_train_strategy  # the hf trainer registered without images=True
    with pytest.raises(ConfigError, match=r"roles.actor_train.strategy.*train strategy 'plain' does not read images "
                                          r"\(the data has them: data.dataset 'color_shapes'\); train strategies that "
                                          r"do: .*hf"):
        load_and_check(None, ["data.dataset=color_shapes", "roles.actor_train.strategy=plain"], plugins)
    rows = tmp_path / "rows.jsonl"  # text rows first, and one that only names the key: images further down
    rows.write_text("".join(json.dumps(row) + "\n" for row in (
        {"prompt": "q", "ground_truth": "x"}, {"prompt": "the word \"images\"", "images": [], "ground_truth": "x"},
        {"prompt": "<image>q", "images": ["a.png"], "ground_truth": "x"})))
    with pytest.raises(ConfigError, match=f"data.train_file {rows}"):
        load_and_check(None, [f"data.train_file={rows}", "roles.actor_train.strategy=plain"], plugins)
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"prompt": "the word \"images\"", "ground_truth": "x"}) + "\n")
    with pytest.raises(ConfigError, match=f"data.eval_file {rows}"):  # held-out images count too
        load_and_check(None, [f"data.train_file={text}", f"data.eval_file={rows}", "roles.actor_train.strategy=plain"],
                       plugins)
    load_and_check(None, [f"data.train_file={text}", "roles.actor_train.strategy=plain"], plugins)
    load_and_check(None, [f"data.train_file={rows}", "roles.critic={strategy: hf}",
                          "algorithm.advantage_estimator=gae"], plugins)  # every built-in model role reads images
    load_and_check(None, ["roles.actor_train.strategy=plain"], plugins)  # text data: any strategy


def test_grpo_on_images_fixes_what_imitation_of_the_careless_teacher_could_not(tmp_path):
    """``examples/vlm.yaml`` in this process (local executor), its RL cut to 25 steps: the warm-up
    imitates a teacher that calls orange "red" and purple "blue", which leaves about a third of the
    held-out images wrong; 25 GRPO steps on an exact-match reward against each image's colour bring
    the held-out accuracy near 100% (measured: 69.7% -> 100%, in about 40 s)."""
    from pathlib import Path

    from roll_core.config import load_config
    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.runtime.executor import LocalExecutor

    example = Path(__file__).resolve().parents[1] / "examples" / "vlm.yaml"
    cfg = load_config(example, ["executor=local", f"output_dir={tmp_path}", "trainer.max_steps=25",
                                "trainer.eval_every=25", "trainer.save_every=0", "trackers=[jsonl]"])
    summary = RLVRPipeline(cfg, LocalExecutor()).run()
    before, after = summary["before_rl"]["eval/accuracy"], summary["after_rl"]["eval/accuracy"]
    assert 0.55 < before < 0.8, before  # the two confused colours of six, wrong under greedy decoding
    assert after > 0.95, (before, after)
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["train/infer_log_prob_gap"] < 1e-5, first  # the engine's and the trainer's policy are one
    # the warmed-up and the trained model read images as the original does: their processor is there
    for exported in (tmp_path / "warm-model", tmp_path / "checkpoints" / "step_000025" / "actor_train" / "model"):
        processor_for.cache_clear()
        assert processor_for(str(exported)).image_token == "<image>", exported


def test_grpo_trains_on_text_rows_and_image_rows_of_one_file(tmp_path, tiny_config):
    """A data file of text prompts and image prompts, one of them with two images, under the async
    scheduler, which encodes each group apart and joins them (other prompt widths, other image
    counts, text groups without images; the sync scheduler encodes a step's prompts together, as
    the tests above do). Every step trains on both kinds, packed."""
    from PIL import Image

    from roll_core.embedded.tasks import ColorShapesTask
    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.pipelines.rollout_dump import load_dump
    from roll_core.runtime.executor import LocalExecutor

    rows = []
    for i, row in enumerate(ColorShapesTask().train_rows()[:4]):
        Image.fromarray(row["images"][0]).save(tmp_path / f"{i}.png")
        rows.append({"prompt": row["prompt"], "images": [f"{i}.png"], "ground_truth": row["ground_truth"]})
    rows[3] = {"prompt": rows[2]["prompt"] + rows[3]["prompt"], "images": ["2.png", "3.png"], "ground_truth": "x"}
    rows += [{"prompt": f"{i}+{i}=", "ground_truth": str(2 * i)} for i in range(4)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = tiny_config(f"data.train_file={data}", f"data.eval_file={data}", "model.tiny.max_position_embeddings=96",
                      "model.tiny.vision={image_size: 16, patch_size: 4}", "warmup.steps=0", "trainer.max_steps=2",
                      "rollout.prompts_per_step=8", "rollout.num_return_sequences=2", "rollout.max_new_tokens=3",
                      "rollout.scheduler=async", "rollout.request_size=2", "data.eval_size=8",
                      "roles.actor_train.pack_sequences=true", "trainer.dump_rollouts_every=1")
    RLVRPipeline(cfg, LocalExecutor()).run()
    for step in (1, 2):  # all 8 rows a step: 4 text prompts, 3 of one image, 1 of two
        batch = load_dump(cfg.output_dir, step)
        assert sorted(batch[IMAGE_COUNTS].tolist()) == [0] * 8 + [1] * 6 + [2] * 2
        assert batch[IMAGES].shape[1] == 2
        ends = batch["prompt_mask"][:, -1]
        assert bool(ends.all())  # every prompt ends where its response starts (left padding)

    """The supervised pipelines build their batches with the prompts' images too: DPO on
    color_shapes' pairs (the true colour over the teacher's) from the raw tiny model, and a
    distillation whose teacher (the tiny model of another seed) writes and scores the responses."""
    from pathlib import Path

    from roll_core.config import load_config
    from roll_core.config.schema import TinyModelConfig, TinyVisionConfig
    from roll_core.embedded.model import build_tiny_model
    from roll_core.pipelines.distill import DistillPipeline
    from roll_core.pipelines.dpo import DPOPipeline
    from roll_core.runtime.executor import LocalExecutor

    example = Path(__file__).resolve().parents[1] / "examples" / "vlm.yaml"
    common = ["executor=local", "trainer.save_every=0", "trackers=[jsonl]", "warmup.steps=0", "data.eval_size=64"]
    cfg = load_config(example, common + ["pipeline=dpo", f"output_dir={tmp_path / 'dpo'}", "trainer.max_steps=20",
                                         "trainer.eval_every=20", "roles.reference={strategy: hf}"])
    dpo = DPOPipeline(cfg, LocalExecutor()).run()
    assert dpo["before"]["eval/rewards/accuracy"] < 0.5 < 0.9 < dpo["after"]["eval/rewards/accuracy"], dpo
    teacher = build_tiny_model(tmp_path / "teacher", TinyModelConfig(vision=TinyVisionConfig(), init_seed=1))
    cfg = load_config(example, common + ["pipeline=distill", f"output_dir={tmp_path / 'distill'}",
                                         "trainer.max_steps=10", "trainer.eval_every=10", "distill.responses=teacher",
                                         f"roles.reference={{strategy: hf, model_path: {teacher}}}"])
    distill = DistillPipeline(cfg, LocalExecutor()).run()
    assert distill["after"]["eval/kl_to_teacher"] < 0.8 * distill["before"]["eval/kl_to_teacher"], distill


def test_the_vision_tower_takes_whole_patches_only():
    from pydantic import ValidationError

    from roll_core.config.schema import TinyVisionConfig

    with pytest.raises(ValidationError, match="image_size 10 is not a multiple of patch_size 4"):
        TinyVisionConfig(image_size=10, patch_size=4)
    assert TinyVisionConfig(image_size=12, patch_size=4).image_size == 12


def test_lora_adapters_on_both_towers_reach_the_engine_merged(tmp_path):
    """LoRA on every linear layer (the encoder's too): after the warm-up's sync the engine's
    log-probs are the trainer's, so every adapter was merged onto its base weight, those transformers
    saves under older names included (AdapterMerger._renamed)."""
    pytest.importorskip("peft")
    from pathlib import Path

    from roll_core.config import load_config
    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.runtime.executor import LocalExecutor

    example = Path(__file__).resolve().parents[1] / "examples" / "vlm.yaml"
    cfg = load_config(example, ["executor=local", f"output_dir={tmp_path}", "trainer.max_steps=1", "warmup.steps=10",
                                "trainer.eval_every=0", "trainer.save_every=0", "trackers=[jsonl]",
                                "roles.actor_train.lora={rank: 8, alpha: 16, target_modules: all-linear}"])
    RLVRPipeline(cfg, LocalExecutor()).run()
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["train/infer_log_prob_gap"] < 1e-5, first


def test_the_critic_reads_each_sample_s_images_and_resumes_its_head(tiny_vlm_path, tmp_path):
    """PPO's value model for an image-text checkpoint (image_value_model.LlavaForTokenClassification):
    the policy's LLaVA weights and a fresh head drawn as for text models; packed values are padded
    ones; the same text over other images has other values; a checkpoint resumes it exactly."""
    from roll_core.config import load_config
    from roll_core.strategies.hf import HFCriticStrategy
    from roll_core.strategies.models import fresh_value_head
    from roll_core.testing import critic_update, image_training_batch

    batch = image_training_batch(tiny_vlm_path)
    values = {}
    for packed in (True, False):
        cfg = load_config(None, ["executor=local", "algorithm.advantage_estimator=gae",
                                 f"roles.critic={{strategy: hf, pack_sequences: {str(packed).lower()}}}"])
        critic = HFCriticStrategy(str(tiny_vlm_path), cfg.roles.critic, seed=3)
        values[packed] = critic.compute_values(batch)
    assert type(critic.model).__name__ == "LlavaForTokenClassification"
    text = critic.model.config.text_config
    torch.testing.assert_close(critic.model.score.weight.data,
                               fresh_value_head(text.hidden_size, text.initializer_range, 3)["weight"])
    torch.testing.assert_close(values[True], values[False], atol=2e-6, rtol=0)
    both = batch["response_mask"][4] * batch["response_mask"][5]
    assert not torch.allclose(values[False][4] * both, values[False][5] * both)
    policy = load_causal_lm_weights(tiny_vlm_path)
    tower = "model.vision_tower.encoder.layers.0.mlp.fc1.weight"
    torch.testing.assert_close(dict(critic.model.named_parameters())[tower].data, policy[tower])
    critic_update(critic, cfg, batch)
    trained = critic.compute_values(batch)
    critic.save_checkpoint(str(tmp_path / "critic"))
    resumed = HFCriticStrategy(str(tiny_vlm_path), cfg.roles.critic, seed=4)
    resumed.load_checkpoint(str(tmp_path / "critic"))
    torch.testing.assert_close(resumed.compute_values(batch), trained, atol=0, rtol=0)
    assert not torch.allclose(trained, values[False])


def load_causal_lm_weights(path) -> dict[str, torch.Tensor]:
    from roll_core.strategies.models import load_causal_lm

    return {name: p.detach() for name, p in load_causal_lm(str(path)).named_parameters()}


def test_a_reward_model_on_image_data_is_refused_before_any_worker(tmp_path):
    """Its export is a transformers sequence classifier, which exists for text models only."""
    from roll_core.config.loader import load_and_check
    from roll_core.plugins import get_plugins

    with pytest.raises(ConfigError, match="pipeline reward_model exports a Hugging Face sequence classifier.*"
                                          r"\(data.dataset 'color_shapes'\)"):
        load_and_check(None, ["pipeline=reward_model", "roles.critic={}", "data.dataset=color_shapes"], get_plugins())
    load_and_check(None, ["pipeline=reward_model", "roles.critic={}"], get_plugins())
