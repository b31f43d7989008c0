"""Rows as the tensors a supervised step trains on: prompt + target, padded or packed.

``sft`` (and ``rlvr``'s warm-up), ``dpo`` and ``distill`` all train on given targets after a prompt;
they build their batches here so the layout (left-padded prompts, right-padded targets plus EOS,
or several examples per packed row) is defined once.
"""

from __future__ import annotations

import torch

from roll_core.data import Batch
from roll_core.errors import ConfigError
from roll_core.multimodal import encode_prompts, has_images


def demonstration_batch(tokenizer, rows: list[dict], target: str = "demonstration") -> Batch:
    """Left-padded prompts (and their images) and right-padded ``row[target] + EOS`` responses (the
    supervised targets)."""
    prompts = encode_prompts(tokenizer, rows)
    # EOS ends each target, unless a chat template's end of turn already put it there
    texts = [r[target] if r[target].rstrip().endswith(tokenizer.eos_token) else r[target] + tokenizer.eos_token
             for r in rows]
    resp = tokenizer(texts, return_tensors="pt",
                     padding=True, add_special_tokens=False, padding_side="right")
    return Batch({**prompts, "responses": resp["input_ids"], "response_mask": resp["attention_mask"]})


def packed_demonstration_batch(tokenizer, rows: list[dict], max_length: int, multiple_of: int = 1) -> Batch:
    """``rows``' prompt + demonstration + EOS sequences packed into as few rows of ``max_length``
    tokens as first-fit over the longest first gives, so no compute goes to padding.

    ``position_ids`` restart at 0 with every example, which is how the model tells the examples of
    a row apart: with no attention mask, transformers makes each attend to itself only. The loss
    mask (``response_mask``) covers the demonstrations; the prompt is each row's first token only.
    Rows of padding alone make the row count a multiple of ``multiple_of`` (data-parallel ranks)."""
    if has_images(rows):
        raise ConfigError("warmup.packing does not take rows with images yet (each example's images would have "
                          "to follow it into its packed row); set warmup.packing: false")
    padded = demonstration_batch(tokenizer, rows)
    examples = []
    for p_ids, p_mask, r_ids, r_mask in zip(padded["prompt_ids"], padded["prompt_mask"], padded["responses"],
                                            padded["response_mask"]):
        prompt, target = p_ids[p_mask.bool()].tolist(), r_ids[r_mask.bool()].tolist()
        if len(prompt) + len(target) > max_length:
            raise ConfigError(f"an example of {len(prompt) + len(target)} tokens does not fit warmup.max_length="
                              f"{max_length}; raise it")
        examples.append((prompt, target))
    bins: list[list[tuple[list[int], list[int]]]] = []
    used: list[int] = []  # tokens in each bin
    for example in sorted(examples, key=lambda e: -(len(e[0]) + len(e[1]))):
        size = len(example[0]) + len(example[1])
        home = next((b for b, n in enumerate(used) if n + size <= max_length), None)
        if home is None:
            bins.append([example])
            used.append(size)
        else:
            bins[home].append(example)
            used[home] += size
    bins += [[] for _ in range(-len(bins) % multiple_of)]
    width = max(used)
    ids = torch.full((len(bins), width), tokenizer.pad_token_id, dtype=torch.long)
    target = torch.zeros(len(bins), width, dtype=torch.long)
    positions = torch.zeros(len(bins), width, dtype=torch.long)
    for row, examples_in_row in enumerate(bins):
        at = 0
        for prompt, answer in examples_in_row:
            n = len(prompt) + len(answer)
            ids[row, at:at + n] = torch.tensor(prompt + answer)
            target[row, at + len(prompt):at + n] = 1
            positions[row, at:at + n] = torch.arange(n)
            at += n
        positions[row, at:] = torch.arange(width - at)  # the padding: one more sequence, out of the loss
    return Batch({"prompt_ids": ids[:, :1], "prompt_mask": torch.ones(len(bins), 1, dtype=torch.long),
                  "responses": ids[:, 1:], "response_mask": target[:, 1:], "position_ids": positions})
