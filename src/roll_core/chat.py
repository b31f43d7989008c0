"""Conversations as prompts: rows with ``messages`` rendered through the tokenizer's chat template.

A row may give its prompt as a conversation, ``{"messages": [{"role": "user", "content": ...}, ...],
...}``, instead of a ``prompt`` string. Every pipeline renders such rows once, after loading them
(:func:`render_rows`), into the strings the rest of roll uses:

* ``prompt``: the conversation up to its last assistant turn, with the template's generation prompt
  (what the model sees before it answers);
* ``demonstration`` (when the conversation ends with an assistant turn and the row has none): the
  rest of the rendered conversation, i.e. the answer with the template's end-of-turn text, so
  ``sft`` trains the answer and how it ends, and the loss stays on the answer's tokens only. Earlier
  assistant turns are context, not targets.

``data.chat_template`` gives a Jinja template for a tokenizer without one (or replaces its own);
``data.apply_chat_template: true`` also renders plain ``prompt`` strings as one user turn (an
instruct model's RLVR prompts). Rows that need a template when the tokenizer has none are an error
that says which setting to use.
"""

from __future__ import annotations

from roll_core.errors import ConfigError


def use_template(tokenizer, template: str | None) -> None:
    """Install ``data.chat_template`` on ``tokenizer`` (no-op for None)."""
    if template is not None:
        tokenizer.chat_template = template


def render_rows(tokenizer, rows: list[dict], *, apply_to_prompts: bool = False) -> list[dict]:
    """``rows`` with every ``messages`` conversation (and, with ``apply_to_prompts``, every plain
    ``prompt``) rendered into ``prompt`` / ``demonstration`` strings. Rows without either come back unchanged."""
    if not any("messages" in row for row in rows) and not apply_to_prompts:
        return rows
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("rows carry 'messages' (or data.apply_chat_template is true) but the model's tokenizer "
                          "has no chat template; set data.chat_template to a Jinja template, or give 'prompt' strings")
    return [_render(tokenizer, row, apply_to_prompts) for row in rows]


def _render(tokenizer, row: dict, apply_to_prompts: bool) -> dict:
    if "messages" not in row:
        if not apply_to_prompts:
            return row
        messages = [{"role": "user", "content": row["prompt"]}]
    else:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and {"role", "content"} <= m.keys()
                                                     for m in messages):
            raise ConfigError(f"a row's 'messages' must be a list of {{role, content}} objects, got {messages!r:.200}")
    answer = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    context = messages[:-1] if answer is not None else messages
    prompt = tokenizer.apply_chat_template(context, tokenize=False, add_generation_prompt=True)
    out = {k: v for k, v in row.items() if k != "messages"}
    out["prompt"] = prompt
    if answer is not None and out.get("demonstration") is None:
        whole = tokenizer.apply_chat_template(messages, tokenize=False)
        if not whole.startswith(prompt):
            raise ConfigError("the chat template renders a conversation differently from its prefix with a generation "
                              "prompt, so the answer cannot be cut out of it; give 'prompt' and 'demonstration' instead")
        out["demonstration"] = whole[len(prompt):]
    return out
