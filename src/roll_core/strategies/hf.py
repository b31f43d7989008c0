"""``hf``: the built-in strategy on plain transformers + torch, for training, inference and reference.

It runs anywhere torch runs (CPU here, one GPU elsewhere) and is the reference the sharded backends
(``deepspeed``, ``megatron``, ``fsdp2``) and the fast inference engines (``vllm``, ``sglang``) are
checked against. Each worker owns its own ``torch.Generator``: sampling never touches the global
RNG, which is what makes the ``local`` and ``ray`` executors agree sample for sample.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import torch

from roll_core.algorithms.objective import actor_loss
from roll_core.data import Batch
from roll_core.strategies.sequences import response_log_probs, sample_responses
from roll_core.strategy import InferStrategy, TrainStrategy


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _load_model(model_path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.to(_device())


def _full_sequence(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([batch["prompt_ids"], batch["responses"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    return ids, mask


class _HFBase:
    def __init__(self, model_path: str, role_config, run_config, seed: int):
        self.model_path, self.role_config, self.run_config = model_path, role_config, run_config
        self.device = _device()
        self.model = _load_model(model_path)
        self.generation_config = self.model.generation_config
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def _to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    @torch.no_grad()
    def compute_log_probs(self, batch: Batch, temperature: float) -> torch.Tensor:
        self.model.eval()
        ids, mask = _full_sequence(batch)
        logp = response_log_probs(self.model, self._to(ids), self._to(mask), batch["responses"].shape[1],
                                  temperature)
        return (logp * self._to(batch["response_mask"])).cpu()

    def rng_state(self):
        return self.generator.get_state()

    def set_rng_state(self, state) -> None:
        self.generator.set_state(state)


class HFInferStrategy(_HFBase, InferStrategy):
    """Generation with a KV-cached sampling loop; log-probs with one forward pass."""

    @torch.no_grad()
    def generate(self, batch: Batch, *, max_new_tokens: int, temperature: float, top_p: float) -> Batch:
        self.model.eval()
        cfg = self.model.config
        responses, mask, logp = sample_responses(
            self.model,
            self._to(batch["prompt_ids"]),
            self._to(batch["prompt_mask"]),
            max_new_tokens=max_new_tokens,
            eos_token_id=cfg.eos_token_id,
            pad_token_id=cfg.pad_token_id,
            temperature=temperature,
            top_p=top_p,
            generator=self.generator,
        )
        return batch.update(responses=responses.cpu(), response_mask=mask.cpu(), infer_log_probs=logp.cpu())

    @torch.no_grad()
    def load_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in bucket:
            params[name].data.copy_(tensor.to(self.device))


class HFTrainStrategy(_HFBase, TrainStrategy):
    """AdamW on the full model; gradient accumulation over micro-batches with global loss denominators."""

    def __init__(self, model_path: str, role_config, run_config, seed: int):
        super().__init__(model_path, role_config, run_config, seed)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=role_config.lr, weight_decay=role_config.weight_decay
        )
        # The supervised warm-up is a separate phase with its own optimizer: carrying its Adam
        # moments (sized for cross-entropy gradients) into RL would shrink the first RL updates.
        self.warmup_optimizer: torch.optim.Optimizer | None = None

    def train_step(self, batch: Batch) -> dict[str, float]:
        algo = self.run_config.algorithm
        temperature = self.run_config.rollout.temperature
        self.model.train()
        totals: dict[str, float] = {}
        counts: dict[str, int] = {}
        for _ in range(algo.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            tokens = float(batch["response_mask"].sum())
            seqs = float(len(batch))
            for micro in batch.split(self.role_config.micro_batch_size):
                ids, mask = _full_sequence(micro)
                logp, entropy = response_log_probs(
                    self.model, self._to(ids), self._to(mask), micro["responses"].shape[1], temperature,
                    with_entropy=True,
                )
                micro_dev = Batch({k: self._to(v) for k, v in micro.tensors.items()}, micro.non_tensors)
                loss, metrics = actor_loss(logp, entropy, micro_dev, algo, global_tokens=tokens, global_seqs=seqs)
                loss.backward()
                for key, value in metrics.items():
                    totals[key] = totals.get(key, 0.0) + value
                    counts[key] = counts.get(key, 0) + 1
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), algo.max_grad_norm)
            if not torch.isfinite(grad_norm):
                # A non-finite gradient would poison the weights: skip the update and report it.
                self.optimizer.zero_grad(set_to_none=True)
                totals["train/skipped_updates"] = totals.get("train/skipped_updates", 0.0) + 1
                counts["train/skipped_updates"] = 1
            else:
                self.optimizer.step()
            totals["train/grad_norm"] = totals.get("train/grad_norm", 0.0) + float(grad_norm)
            counts["train/grad_norm"] = counts.get("train/grad_norm", 0) + 1
        # Losses were scaled by mini-batch denominators, so micro-batch values add up; per-epoch
        # values and ratios are averaged.
        summed = {"train/pg_loss", "train/kl", "train/entropy"}
        return {
            k: (v / algo.ppo_epochs if k in summed else v / counts[k]) for k, v in totals.items()
        }

    def sft_step(self, batch: Batch, lr: float) -> dict[str, float]:
        if self.warmup_optimizer is None:
            self.warmup_optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        optimizer = self.warmup_optimizer
        for group in optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        optimizer.zero_grad(set_to_none=True)
        ids, mask = _full_sequence(batch)
        logp = response_log_probs(self.model, self._to(ids), self._to(mask), batch["responses"].shape[1], 1.0)
        rmask = self._to(batch["response_mask"]).float()
        loss = -(logp * rmask).sum() / rmask.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.run_config.algorithm.max_grad_norm)
        optimizer.step()
        return {"warmup/loss": float(loss.detach())}

    def weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        bucket, size = [], 0
        for name, param in self.model.named_parameters():
            tensor = param.detach().cpu()
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def save_checkpoint(self, path: str) -> None:
        path = Path(path)
        self.model.save_pretrained(path / "model", safe_serialization=True)
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state()},
            path / "train_state.pt",
        )

    def load_checkpoint(self, path: str) -> None:
        path = Path(path)
        # from_pretrained resolves tied weights and shards the same way it does for any checkpoint.
        self.model.load_state_dict(_load_model(str(path / "model")).state_dict())
        state = torch.load(path / "train_state.pt", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
