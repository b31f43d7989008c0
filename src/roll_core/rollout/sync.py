"""``sync``: generate every group, then score every sample. Simple, deterministic, the baseline."""

from __future__ import annotations

import torch

from roll_core.data import Batch
from roll_core.rewards import RewardInput
from roll_core.rollout import RolloutScheduler


def tokenize_prompts(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``[B, P]`` ids and mask, without BOS/EOS (prompts are used verbatim)."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False, padding_side="left")
    return enc["input_ids"], enc["attention_mask"]


def outcome_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score on its last valid response token. ``[B]`` -> ``[B, R]``."""
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = (response_mask.sum(-1) - 1).clamp(min=0)
    rewards[torch.arange(len(scores)), last] = scores.float()
    return rewards * (response_mask.sum(-1, keepdim=True) > 0)


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
