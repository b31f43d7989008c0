"""``reward_model``: scores from a sequence-classification checkpoint, built here on the tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from roll_core.rewards import RewardInput

CHAT = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """The tiny model's architecture and tokenizer as a one-label sequence classifier, with a chat
    template that ends each turn with ``</s>``; its tokenizer starts each text with ``<s>``, as
    Llama's do."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    from roll_core.embedded.model import build_tiny_model

    root = tmp_path_factory.mktemp("rm")
    tiny = build_tiny_model(root / "tiny")
    config = AutoConfig.from_pretrained(tiny, num_labels=1)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(root / "rm")
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    tokenizer.chat_template = CHAT
    tokenizer._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save_pretrained(root / "rm")
    return root


def alone(rm_path, ids: list[int]) -> float:
    """The checkpoint's score of one unpadded row, read at its last token."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32)
    model.config.pad_token_id = None  # a single row: transformers reads the last position
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def sample(prompt: str, response: str) -> RewardInput:
    return RewardInput(prompt=prompt, response=response, ground_truth="")


def test_batched_scores_are_each_rows_own_even_when_a_row_ends_in_the_padding_token(rm_dir):
    from roll_rewards.reward_model import RewardModelReward

    reward = RewardModelReward(str(rm_dir / "rm"), batch_size=3)
    # '<pad>' is the checkpoint's pad id: transformers alone would read that row one token early
    samples = [sample("12+34=", "046"), sample("1+1=", "2<pad>"), sample("7+8=", "15 and more"),
               sample("9+9=", "18")]
    ids = [reward.tokenizer(s.prompt + s.response)["input_ids"] for s in samples]
    assert ids[1][-1] == reward.tokenizer.pad_token_id == 0 and ids[0][0] == 1  # the text after its BOS
    expected = [alone(rm_dir / "rm", row) for row in ids]
    passes = []
    forward = reward._logits
    reward._logits = lambda *args: passes.append(len(args[0])) or forward(*args)
    assert reward.score_batch(samples) == pytest.approx(expected, abs=1e-5)
    assert passes == [3, 1]  # batch_size rows a pass
    assert reward.score(samples[1]) == pytest.approx(expected[1], abs=1e-5)
    assert len(set(round(x, 4) for x in expected)) == 4  # the rows score differently: a real check


def test_rows_that_hold_every_token_id_are_scored_one_at_a_time(rm_dir):
    from roll_rewards.reward_model import RewardModelReward

    reward = RewardModelReward(str(rm_dir / "rm"))
    vocab = reward.tokenizer.convert_ids_to_tokens(list(range(len(reward.tokenizer))))
    every = sample("".join(vocab), "")
    short = sample("1+2=", "3")
    ids = [reward.tokenizer(s.prompt + s.response)["input_ids"] for s in (every, short)]
    assert sorted(set(ids[0])) == list(range(len(reward.tokenizer)))
    assert reward.score_batch([every, short]) == pytest.approx([alone(rm_dir / "rm", row) for row in ids], abs=1e-5)


def test_a_long_text_keeps_its_end_and_is_counted(rm_dir):
    from roll_rewards.reward_model import RewardModelReward

    reward = RewardModelReward(str(rm_dir / "rm"), max_length=8)
    long = sample("123456789+", "987654321")
    ids = reward.tokenizer(long.prompt + long.response)["input_ids"]
    kept = ids[:1] + ids[-7:]  # the BOS, then the text's last 7 tokens
    assert reward.score_batch([long, sample("1+2=", "3")])[0] == pytest.approx(alone(rm_dir / "rm", kept), abs=1e-5)
    assert reward.metrics() == {"truncated": 1.0}
    assert reward.metrics() == {"truncated": 0.0}  # counts since the last call
    exact = sample("1+2", "=3")  # <s> and 5 characters: max_length=6 takes it whole
    ids = reward.tokenizer(exact.prompt + exact.response)["input_ids"]
    six = RewardModelReward(str(rm_dir / "rm"), max_length=6)
    assert six.score_batch([exact]) == pytest.approx([alone(rm_dir / "rm", ids)], abs=1e-5)
    assert len(ids) == 6 and six.metrics() == {"truncated": 0.0}


def test_the_chat_template_frames_prompt_and_response_as_turns(rm_dir):
    from roll_rewards.reward_model import RewardModelReward

    reward = RewardModelReward(str(rm_dir / "rm"), template="chat")
    s = sample("1+2=", "3")
    assert reward.text(s) == "[user]1+2=</s>[assistant]3</s>"
    assert RewardModelReward(str(rm_dir / "rm")).text(s) == "1+2=3"
    ids = reward.tokenizer(reward.text(s), add_special_tokens=False)["input_ids"]
    assert ids[0] != 1  # the template's text alone: no BOS before it
    assert reward.score_batch([s, sample("12+3=", "15")])[0] == pytest.approx(alone(rm_dir / "rm", ids), abs=1e-5)


def test_bf16_scores_near_fp32_and_other_precisions_are_refused(rm_dir):
    from roll_rewards.reward_model import RewardModelReward

    s = [sample("12+34=", "046"), sample("1+1=", "2")]
    fp32 = RewardModelReward(str(rm_dir / "rm")).score_batch(s)
    bf16 = RewardModelReward(str(rm_dir / "rm"), precision="bf16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    assert bf16.score_batch(s) == pytest.approx(fp32, abs=0.05)
    with pytest.raises(ValueError, match="precision must be 'fp32' or 'bf16', got 'fp16'"):
        RewardModelReward(str(rm_dir / "rm"), precision="fp16")


def test_checkpoints_that_are_not_one_label_classifiers_are_refused_in_one_line(rm_dir, tmp_path):
    from roll_rewards.reward_model import RewardModelReward

    with pytest.raises(ValueError) as err:
        RewardModelReward(str(tmp_path))
    assert str(err.value) == (f"reward_model: model_path '{tmp_path}' is not a Hugging Face model directory "
                              f"(no config.json)")
    with pytest.raises(ValueError) as err:
        RewardModelReward(str(rm_dir / "tiny"))
    assert str(err.value) == (f"reward_model: '{rm_dir / 'tiny'}' is not a sequence classifier (architectures: "
                              f"LlamaForCausalLM); a reward model is saved as ...ForSequenceClassification with "
                              f"one label")
    two = tmp_path / "two"
    two.mkdir()
    config = json.loads((rm_dir / "rm" / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**config, "id2label": {"0": "bad", "1": "good"}}))
    with pytest.raises(ValueError, match=r"has 2 labels; a reward model gives one score \(num_labels: 1\)"):
        RewardModelReward(str(two))
    with pytest.raises(ValueError, match="template 'chat' needs a chat template"):
        _without_chat(rm_dir, tmp_path)
    with pytest.raises(ValueError, match="template must be 'concat' or 'chat', got 'raw'"):
        RewardModelReward(str(rm_dir / "rm"), template="raw")
    with pytest.raises(ValueError, match="max_length must be at least 2 and batch_size at least 1, got 8 and 0"):
        RewardModelReward(str(rm_dir / "rm"), max_length=8, batch_size=0)


def _without_chat(rm_dir, tmp_path):
    import shutil

    from roll_rewards.reward_model import RewardModelReward

    plain = tmp_path / "plain"
    shutil.copytree(rm_dir / "rm", plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    RewardModelReward(str(plain), template="chat")


def test_an_rlvr_run_trains_on_the_reward_models_scores(rm_dir, tmp_path):
    import roll_core
    from roll_core.trackers import read_metrics

    out = tmp_path / "run"
    summary = roll_core.run(None, [f"output_dir={out}", "executor=local", "warmup.steps=0", "trainer.max_steps=2",
                                   "rollout.prompts_per_step=2", "rollout.num_return_sequences=2",
                                   "trainer.eval_every=0", "trainer.save_every=0", "data.eval_size=2",
                                   "trackers=[jsonl]", "roles.reward.name=reward_model",
                                   f"roles.reward.options={{model_path: {rm_dir / 'rm'}, batch_size: 3}}"])
    rows = read_metrics(out / "metrics.jsonl")
    assert summary["steps"] == 2 and [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    # an unbounded score, not a 0/1 match: the model's own numbers reach the step's metrics
    assert all(r["reward/mean"] not in (0.0, 1.0) and r["reward/reward_model/truncated"] == 0.0
               for r in rows if "reward/mean" in r)
