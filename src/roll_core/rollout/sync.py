"""``sync``: generate every group, then score every sample. Simple, deterministic, the baseline."""

from __future__ import annotations

import torch

from roll_core.algorithms.shaping import outcome_token_rewards
from roll_core.data import Batch
from roll_core.rewards import RewardInput
from roll_core.rollout import RolloutScheduler


def tokenize_prompts(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``[B, P]`` ids and mask, without BOS/EOS (prompts are used verbatim)."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False, padding_side="left")
    return enc["input_ids"], enc["attention_mask"]


class SyncRolloutScheduler(RolloutScheduler):
    def collect(self, rows, *, num_return_sequences, temperature):
        expanded = [row for row in rows for _ in range(num_return_sequences)]
        group_index = torch.arange(len(rows)).repeat_interleave(num_return_sequences)
        prompt_ids, prompt_mask = tokenize_prompts(self.tokenizer, [r["prompt"] for r in expanded])
        batch = Batch(
            {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "group_index": group_index},
            {
                "prompt": [r["prompt"] for r in expanded],
                "ground_truth": [r["ground_truth"] for r in expanded],
                "domain": [r.get("domain", "default") for r in expanded],
            },
        )
        rollout = self.config.rollout
        parts = self.executor.get(self.infer.map(
            "generate", batch.chunk(len(self.infer)), max_new_tokens=rollout.max_new_tokens,
            temperature=temperature, top_p=rollout.top_p,
        ))
        batch = Batch.concat(parts)
        # Cut off at max_new_tokens without EOS (for algorithm.max_length_mask).
        lengths = batch["response_mask"].sum(-1)
        last = batch["responses"].gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
        truncated = (lengths >= rollout.max_new_tokens) & (last != self.tokenizer.eos_token_id)
        batch.update(truncated=truncated)
        texts = self.tokenizer.batch_decode(batch["responses"], skip_special_tokens=True)
        samples = [
            RewardInput(p, t, g, d)
            for p, t, g, d in zip(batch["prompt"], texts, batch["ground_truth"], batch["domain"])
        ]
        chunks, start = [], 0
        for part in batch.chunk(len(self.reward)):
            chunks.append(samples[start : start + len(part)])
            start += len(part)
        scores = torch.tensor([s for part in self.executor.get(self.reward.map("score", chunks)) for s in part])
        return batch.update(
            response_text=texts,
            scores=scores,
            token_level_rewards=outcome_token_rewards(scores, batch["response_mask"]),
        )
