"""``reward_model``: a trained reward model scores each response, for RLHF where no verifier exists.

The model is a Hugging Face sequence-classification checkpoint with one label, the format of
published reward models and of what TRL's ``RewardTrainer`` and OpenRLHF save
(``LlamaForSequenceClassification``, ``Qwen2ForSequenceClassification``, ... with ``num_labels:
1``), read from a local directory. Each reward worker loads it once, on its GPU when the role's
``device_mapping`` gives it one (else on the CPU), and scores ``batch_size`` samples per forward
pass. The reward is the model's scalar for the whole text, as it was trained: unbounded, so use
group or batch normalisation of advantages (GRPO, RLOO, REINFORCE++ do) or ``algorithm.reward_norm``.

What the model reads (``template``):

* ``concat``: the prompt exactly as the policy saw it, then the response, as one text. Right for a
  reward model trained on the same formatting as the policy's data.
* ``chat``: the reward model's own chat template over a user turn (the prompt) and an assistant turn
  (the response). Right for published chat reward models when the data's prompts are plain text.

Texts longer than ``max_length`` tokens lose the start of their text (a BOS the tokenizer adds
stays), never their end: the model reads its score at the last token, which must be the
response's. ``metrics()`` counts them (``reward/reward_model/truncated``).

    roll run roles.reward.name=reward_model roles.reward.options.model_path=/models/my-rm \\
        roles.reward.device_mapping=[1]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from roll_core.rewards import Reward, RewardInput


class RewardModelReward(Reward):
    def __init__(self, model_path: str, *, template: Literal["concat", "chat"] = "concat", max_length: int = 2048,
                 batch_size: int = 16, precision: Literal["fp32", "bf16"] = "fp32"):
        if template not in ("concat", "chat"):
            raise ValueError(f"reward_model: template must be 'concat' or 'chat', got {template!r}")
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"reward_model: precision must be 'fp32' or 'bf16', got {precision!r}")
        if max_length < 2 or batch_size < 1:
            raise ValueError(f"reward_model: max_length must be at least 2 and batch_size at least 1, got "
                             f"{max_length} and {batch_size}")
        _check_checkpoint(model_path)
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from roll_core.strategies.models import default_device

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if template == "chat" and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"reward_model: template 'chat' needs a chat template, and the tokenizer of "
                             f"'{model_path}' has none; use template: concat")
        self.tokenizer.padding_side, self.tokenizer.truncation_side = "right", "left"
        self.device = default_device()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=dtype).to(self.device)
        self.model.eval()
        self.template, self.max_length, self.batch_size = template, max_length, batch_size
        self.truncated = 0

    @classmethod
    def contract_examples(cls):
        """None here: scoring needs a reward model checkpoint (tests/test_reward_model.py builds one)."""
        return []

    def text(self, sample: RewardInput) -> str:
        """What the reward model reads for ``sample`` (``template``)."""
        if self.template == "concat":
            return sample.prompt + sample.response
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": sample.prompt}, {"role": "assistant", "content": sample.response}],
            tokenize=False)

    def score(self, sample: RewardInput) -> float:
        return self.score_batch([sample])[0]

    def score_batch(self, samples: list[RewardInput]) -> list[float]:
        scores: list[float] = []
        for start in range(0, len(samples), self.batch_size):
            scores += self._forward([self.text(s) for s in samples[start:start + self.batch_size]])
        return scores

    def _forward(self, texts: list[str]) -> list[float]:
        # the chat template writes its special tokens itself; concat adds the tokenizer's (a BOS)
        special = self.template == "concat"
        enc = self.tokenizer(texts, add_special_tokens=special, padding=True, return_tensors="pt")
        over = int((enc["attention_mask"].sum(1) > self.max_length).sum())
        if over:  # again, cut by the tokenizer (its special tokens kept); most batches need one pass
            self.truncated += over
            enc = self.tokenizer(texts, add_special_tokens=special, padding=True, truncation=True,
                                 max_length=self.max_length, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        # transformers reads a sequence classifier's score at the last token that is not its config's
        # pad id; a text ending in that id (an EOS that doubles as padding, as many chat templates
        # write) would be read one token early. Padding with an id no row contains avoids it.
        pad = _absent_id(ids, mask, self.model.get_input_embeddings().num_embeddings)
        if pad is None:  # the rows use every id there is: one row at a time, read at its last token
            return [score for i in range(len(texts)) for score in self._logits(ids[i:i + 1, mask[i].bool()], None)]
        return self._logits(ids.masked_fill(mask == 0, pad), mask, pad)

    def _logits(self, ids, mask, pad: int | None = None) -> list[float]:
        import torch

        self.model.config.pad_token_id = pad
        with torch.no_grad():
            out = self.model(input_ids=ids.to(self.device),
                             attention_mask=None if mask is None else mask.to(self.device))
        return out.logits[:, 0].float().cpu().tolist()

    def metrics(self) -> dict[str, float]:
        """Texts cut to ``max_length`` since the last call."""
        out, self.truncated = {"truncated": float(self.truncated)}, 0
        return out


def _absent_id(ids, mask, vocab_size: int) -> int | None:
    """The smallest token id that no row of ``ids`` holds at a real (unmasked) position; None when
    they hold every id of the vocabulary."""
    import torch

    present = torch.zeros(vocab_size, dtype=torch.bool)
    present[ids[mask.bool()]] = True
    absent = (~present).nonzero()
    return int(absent[0]) if len(absent) else None


def _check_checkpoint(model_path: str) -> None:
    """A one-line error unless ``model_path`` holds a sequence classifier with one label."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        raise ValueError(f"reward_model: model_path '{model_path}' is not a Hugging Face model directory "
                         f"(no config.json)")
    data = json.loads(config.read_text())
    architectures = data.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(f"reward_model: '{model_path}' is not a sequence classifier (architectures: "
                         f"{', '.join(architectures) or 'none'}); a reward model is saved as "
                         f"...ForSequenceClassification with one label")
    labels = len(data.get("id2label") or {}) or data.get("num_labels", 2)
    if labels != 1:
        raise ValueError(f"reward_model: '{model_path}' has {labels} labels; a reward model gives one score "
                         f"(num_labels: 1)")
