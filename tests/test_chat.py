"""Conversations (rows with ``messages``) through the chat template: rendering, errors, and ``sft``
training on the answer only."""

from __future__ import annotations

import json

import pytest

from roll_core.chat import render_rows
from roll_core.errors import ConfigError
from roll_core.pipelines.runtime import load_tokenizer

# The embedded tokenizer has no template of its own (and no newline in its vocabulary).
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}"
            "{{ eos_token }}{% else %} | {% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def conversation(question: str, answer: str | None = None, system: str = "add the numbers") -> list[dict]:
    turns = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return turns + ([{"role": "assistant", "content": answer}] if answer is not None else [])


def test_a_conversation_becomes_a_prompt_and_its_last_answer_the_demonstration(tiny_model_path):
    tokenizer = load_tokenizer(str(tiny_model_path), TEMPLATE)
    rows = render_rows(tokenizer, [
        {"messages": conversation("12+34=", "46"), "ground_truth": "46"},
        {"messages": conversation("1+1="), "ground_truth": "2"},
        {"prompt": "2+2=", "ground_truth": "4"},  # a plain prompt stays verbatim
    ])
    assert rows[0] == {"prompt": "system: add the numbers | user: 12+34= | assistant: ", "demonstration": "46</s>",
                       "ground_truth": "46"}
    assert rows[1] == {"prompt": "system: add the numbers | user: 1+1= | assistant: ", "ground_truth": "2"}
    assert rows[2] == {"prompt": "2+2=", "ground_truth": "4"}
    # earlier answers are context: only the last one is the target
    (multi,) = render_rows(tokenizer, [{"messages": [*conversation("1+1=", "2"), {"role": "user", "content": "2+2="},
                                                     {"role": "assistant", "content": "4"}]}])
    assert multi["prompt"].endswith("assistant: 2</s>user: 2+2= | assistant: ") and multi["demonstration"] == "4</s>"


def test_plain_prompts_become_one_user_turn_when_asked(tiny_model_path):
    tokenizer = load_tokenizer(str(tiny_model_path), TEMPLATE)
    (row,) = render_rows(tokenizer, [{"prompt": "2+2=", "ground_truth": "4"}], apply_to_prompts=True)
    assert row == {"prompt": "user: 2+2= | assistant: ", "ground_truth": "4"}


def test_a_conversation_without_a_template_names_the_setting(tiny_model_path):
    tokenizer = load_tokenizer(str(tiny_model_path))
    with pytest.raises(ConfigError, match="the model's tokenizer has no chat template; set data.chat_template"):
        render_rows(tokenizer, [{"messages": conversation("1+1=", "2")}])
    assert render_rows(tokenizer, [{"prompt": "1+1="}]) == [{"prompt": "1+1="}]  # nothing to render: fine


def test_a_tokenizer_keeps_its_own_template_unless_the_config_gives_one(tiny_model_path):
    from roll_core.chat import use_template

    tokenizer = load_tokenizer(str(tiny_model_path), TEMPLATE)
    use_template(tokenizer, None)  # data.chat_template unset
    assert tokenizer.chat_template == TEMPLATE
    use_template(tokenizer, "{{ messages[0]['content'] }}")
    assert render_rows(tokenizer, [{"messages": conversation("1+1=")}])[0]["prompt"] == "add the numbers"
    tokenizer.chat_template = ""  # an empty template is none
    with pytest.raises(ConfigError, match="has no chat template"):
        render_rows(tokenizer, [{"messages": conversation("1+1=")}])


def test_a_row_s_own_demonstration_wins_over_its_conversation_s_answer(tiny_model_path):
    tokenizer = load_tokenizer(str(tiny_model_path), TEMPLATE)
    (row,) = render_rows(tokenizer, [{"messages": conversation("12+34=", "46"), "demonstration": "forty-six"}])
    assert row == {"prompt": "system: add the numbers | user: 12+34= | assistant: ", "demonstration": "forty-six"}


def test_a_template_whose_generation_prompt_is_not_a_prefix_of_the_conversation_is_refused(tiny_model_path):
    # the generation prompt says "assistant:" but a rendered answer turn "bot:", so the answer cannot be cut out
    template = TEMPLATE.replace("{{ m['role'] }}: ", "{{ 'bot' if m['role'] == 'assistant' else m['role'] }}: ")
    tokenizer = load_tokenizer(str(tiny_model_path), template)
    with pytest.raises(ConfigError, match="renders a conversation differently from its prefix with a generation"):
        render_rows(tokenizer, [{"messages": conversation("1+1=", "2")}])
    (row,) = render_rows(tokenizer, [{"messages": conversation("1+1=")}])  # no answer to cut out: fine
    assert row["prompt"].endswith("assistant: ")


@pytest.mark.parametrize("messages", [[{"role": "user"}], "1+1=", [["user", "1+1="]]])
def test_malformed_messages_are_refused(tiny_model_path, messages):
    tokenizer = load_tokenizer(str(tiny_model_path), TEMPLATE)
    with pytest.raises(ConfigError, match="a row's 'messages' must be a list of {role, content} objects"):
        render_rows(tokenizer, [{"messages": messages}])


def test_the_demonstration_ends_with_one_eos_and_the_loss_covers_the_answer_only(tiny_model_path):
    from roll_core.pipelines.batches import demonstration_batch

    tokenizer = load_tokenizer(str(tiny_model_path), TEMPLATE)
    rows = render_rows(tokenizer, [{"messages": conversation("12+34=", "46")},
                                   {"prompt": "1+1=", "demonstration": "2"}])
    batch = demonstration_batch(tokenizer, rows)
    eos = tokenizer.eos_token_id
    answers = [tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(batch["responses"], batch["response_mask"])]
    assert answers == ["46</s>", "2</s>"]  # the template's EOS is not doubled; a plain target gets one
    assert int((batch["responses"][0] == eos).sum()) == 1
    # a target that ends in EOS and then whitespace (a template's newline after the turn) gets no second EOS
    spaced = demonstration_batch(tokenizer, [{"prompt": "1+1=", "demonstration": "2</s>\n"}])
    assert int((spaced["responses"] == eos).sum()) == 1


def test_no_special_token_is_added_to_prompts_or_targets(tiny_model_path):
    from roll_core.pipelines.batches import demonstration_batch

    tokenizer = load_tokenizer(str(tiny_model_path))
    tokenizer.add_bos_token = True  # as Llama's tokenizers do: text is tokenized verbatim all the same
    assert tokenizer("2")["input_ids"][0] == tokenizer.bos_token_id
    batch = demonstration_batch(tokenizer, [{"prompt": "1+1=", "demonstration": "2"}])
    assert tokenizer.decode(batch["prompt_ids"][0]) == "1+1=" and tokenizer.decode(batch["responses"][0]) == "2</s>"


def test_sft_on_conversations_lowers_the_held_out_loss(tmp_path):
    from roll_core.config import load_config
    from roll_core.embedded.tasks import CarryAdditionTask
    from roll_core.pipelines.sft import SFTPipeline
    from roll_core.runtime.executor import LocalExecutor

    task = CarryAdditionTask()
    for name, rows in (("train", task.train_rows()[:300]), ("eval", task.eval_rows()[:32])):
        lines = [json.dumps({"messages": conversation(r["prompt"], r.get("demonstration") or r["ground_truth"])})
                 for r in rows]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    cfg = load_config(None, [f"output_dir={tmp_path / 'run'}", "executor=local", "pipeline=sft", "warmup.steps=40",
                             "trainer.eval_every=40", "trainer.save_every=0", "trackers=[jsonl]",
                             f"data.train_file={tmp_path / 'train.jsonl'}", f"data.eval_file={tmp_path / 'eval.jsonl'}",
                             f"data.chat_template={json.dumps(TEMPLATE)}"])
    summary = SFTPipeline(cfg, LocalExecutor()).run()
    before, after = summary["before"]["eval/loss"], summary["after"]["eval/loss"]
    assert after < 0.6 * before, (before, after)
    saved = load_tokenizer(str(tmp_path / "run" / "checkpoints" / "step_000040" / "actor_train" / "model"))
    assert saved.chat_template == TEMPLATE  # the exported model carries its template


def test_rlvr_refuses_rows_without_ground_truth(tmp_path):
    from roll_core.config import load_config
    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.runtime.executor import LocalExecutor

    (tmp_path / "train.jsonl").write_text(json.dumps({"messages": conversation("1+1=", "2")}) + "\n")
    cfg = load_config(None, [f"output_dir={tmp_path / 'run'}", "executor=local",
                             f"data.train_file={tmp_path / 'train.jsonl'}",
                             f"data.chat_template={json.dumps(TEMPLATE)}", "warmup.steps=0"])
    with pytest.raises(ConfigError, match="1 training rows have no 'ground_truth' \\(the first: row 0\\)"):
        RLVRPipeline(cfg, LocalExecutor()).run()
