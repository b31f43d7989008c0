"""``hf``: the built-in strategy on plain transformers + torch, for training, inference and reference.

It runs anywhere torch runs (CPU here, one GPU elsewhere) and is the reference the sharded backends
(``deepspeed``, ``megatron``, ``fsdp2``) and the fast inference engines (``vllm``, ``sglang``) are
checked against. Each worker owns its own ``torch.Generator``: sampling never touches the global
RNG, which is what makes the ``local`` and ``ray`` executors agree sample for sample.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from roll_core.algorithms.objective import actor_loss, critic_loss, loss_denominators, needs_distribution
from roll_core.data import Batch
from roll_core.runtime.distributed import all_reduce_sum, rank_world, sum_gradients
from roll_core.strategies.sequences import position_ids_from_mask, response_log_probs, sample_responses
from roll_core.strategy import CriticStrategy, InferStrategy, TrainStrategy, request_cancelled


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _load_model(model_path: str):
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.to(_device())


def _full_sequence(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([batch["prompt_ids"], batch["responses"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    return ids, mask


class _Offloading:
    """Colocation: on a GPU the model (and the optimizer's moments) go to host memory while another
    role uses the device. On CPU there is nothing to free."""

    device: torch.device

    def offload(self) -> None:
        if self.device.type != "cpu":
            _move_states(self, torch.device("cpu"))

    def reload(self) -> None:
        if self.device.type != "cpu":
            _move_states(self, self.device)


class _HFBase(_Offloading):
    def __init__(self, model_path: str, role_config, run_config, seed: int):
        self.model_path, self.role_config, self.run_config = model_path, role_config, run_config
        self.device = _device()
        self.model = _load_model(model_path)
        self.generation_config = self.model.generation_config
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def _to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    @torch.no_grad()
    def compute_log_probs(self, batch: Batch, temperature: float, distribution: bool = False) -> torch.Tensor:
        self.model.eval()
        ids, mask = _full_sequence(batch)
        rmask = self._to(batch["response_mask"])
        out = response_log_probs(self.model, self._to(ids), self._to(mask), batch["responses"].shape[1],
                                 temperature, with_distribution=distribution)
        if distribution:
            return (out[2] * rmask[..., None]).cpu()
        return (out * rmask).cpu()

    def rng_state(self):
        return self.generator.get_state()

    def set_rng_state(self, state) -> None:
        self.generator.set_state(state)


def _move_states(strategy, device: torch.device) -> None:
    strategy.model.to(device)
    for optimizer in (getattr(strategy, "optimizer", None), getattr(strategy, "warmup_optimizer", None)):
        for state in (optimizer.state.values() if optimizer is not None else ()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.to(device)
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.empty_cache()


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
            should_stop=request_cancelled,
        )
        return batch.update(responses=responses.cpu(), response_mask=mask.cpu(), infer_log_probs=logp.cpu())

    @torch.no_grad()
    def load(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in bucket:
            params[name].data.copy_(tensor.to(self.device))


# Metrics that are shares of a mini-batch loss (scaled by global denominators) add up over its
# micro-batches; every other metric is a per-micro-batch mean and is averaged.
_ADDITIVE = {"train/pg_loss", "train/kl", "train/entropy", "critic/value_loss"}


class _Optimizing:
    """The update loop shared by the actor and the critic: epochs x mini-batches x micro-batches.

    Each mini-batch is one optimizer step. Its loss denominators are counted over the whole
    mini-batch before it is split (and summed over data-parallel ranks, each of which holds an
    equal share of it), so accumulating micro-batch gradients and summing them over ranks gives the
    gradient of the mini-batch loss whatever ``micro_batch_size`` and the number of workers are.
    A non-finite gradient norm (a NaN or inf loss) skips the step on every rank and is reported.
    """

    model: Any  # a transformers model
    optimizer: torch.optim.Optimizer
    role_config: Any
    run_config: Any
    metric_prefix: str  # "train" or "critic"
    _to: Callable[[torch.Tensor], torch.Tensor]  # to the strategy's device

    def micro_loss(self, micro: Batch, tokens: float, seqs: float) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def accumulate_gradients(self, mini: Batch) -> dict[str, float]:
        """Backward passes over the micro-batches of ``mini`` (no optimizer step). Returns metrics."""
        tokens, seqs = all_reduce_sum(list(loss_denominators(mini)))
        totals: dict[str, float] = {}
        n_micro = 0
        for micro in mini.split(self.role_config.micro_batch_size):
            micro = Batch({k: self._to(v) for k, v in micro.tensors.items()}, micro.non_tensors)
            loss, metrics = self.micro_loss(micro, tokens, seqs)
            loss.backward()
            n_micro += 1
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value
        self.reduce_gradients()
        return {k: v if k in _ADDITIVE else v / n_micro for k, v in totals.items()}

    def reduce_gradients(self) -> None:
        """Sum gradients over data-parallel ranks (replicated model)."""
        sum_gradients(self.model.parameters())

    def optimize(self, batch: Batch) -> dict[str, float]:
        """``batch`` is this rank's share: ``1 / world`` of every mini-batch, in order."""
        algo = self.run_config.algorithm
        self.model.train()
        world = rank_world()[1]
        size = algo.ppo_mini_batch_size // world if algo.ppo_mini_batch_size else len(batch)
        sums: dict[str, float] = {}
        updates = 0
        skipped = 0
        for _ in range(algo.ppo_epochs):
            for mini in batch.split(size):
                self.optimizer.zero_grad(set_to_none=True)
                metrics = self.accumulate_gradients(mini)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), algo.max_grad_norm)
                if hasattr(grad_norm, "full_tensor"):  # sharded parameters give a DTensor norm
                    grad_norm = grad_norm.full_tensor()
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                else:
                    # A non-finite gradient would poison the weights: skip the update and report it.
                    self.optimizer.zero_grad(set_to_none=True)
                    skipped += 1
                metrics[f"{self.metric_prefix}/grad_norm"] = float(grad_norm)
                updates += 1
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
        out = {k: v / updates for k, v in sums.items()}
        out[f"{self.metric_prefix}/skipped_updates"] = float(skipped)
        return _reduce_metrics(out, world)


def _reduce_metrics(metrics: dict[str, float], world: int) -> dict[str, float]:
    """Whole-batch metrics from per-rank ones: loss shares add up, everything else is averaged
    (values that are equal on every rank, like the gradient norm, stay as they are)."""
    if world == 1:
        return metrics
    keys = sorted(metrics)
    totals = all_reduce_sum([metrics[k] for k in keys])
    return {k: t if k in _ADDITIVE else t / world for k, t in zip(keys, totals)}


class HFTrainStrategy(_Optimizing, _HFBase, TrainStrategy):
    """AdamW on the full model; gradient accumulation over micro-batches with global loss denominators."""

    metric_prefix = "train"

    def __init__(self, model_path: str, role_config, run_config, seed: int):
        super().__init__(model_path, role_config, run_config, seed)
        self.prepare_model()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=role_config.lr, weight_decay=role_config.weight_decay
        )
        # The supervised warm-up is a separate phase with its own optimizer: carrying its Adam
        # moments (sized for cross-entropy gradients) into RL would shrink the first RL updates.
        self.warmup_optimizer: torch.optim.Optimizer | None = None

    def prepare_model(self) -> None:
        """Hook for subclasses that wrap or shard the model before the optimizer is built."""

    def micro_loss(self, micro: Batch, tokens: float, seqs: float):
        algo = self.run_config.algorithm
        ids, mask = _full_sequence(micro)
        logp, entropy, log_dist = response_log_probs(
            self.model, ids, mask, micro["responses"].shape[1], self.run_config.rollout.temperature,
            with_entropy=True, with_distribution=needs_distribution(algo),
        )
        return actor_loss(logp, entropy, micro, algo, global_tokens=tokens, global_seqs=seqs,
                          max_response_length=self.run_config.rollout.max_new_tokens, log_dist=log_dist)

    def train_step(self, batch: Batch) -> dict[str, float]:
        return self.optimize(batch)

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
        tokens = all_reduce_sum([float(rmask.sum())])[0]
        loss = -(logp * rmask).sum() / max(tokens, 1.0)
        loss.backward()
        self.reduce_gradients()
        loss_value = all_reduce_sum([float(loss.detach())])[0]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.run_config.algorithm.max_grad_norm)
        optimizer.step()
        return {"warmup/loss": loss_value}

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor on CPU)`` of every parameter; sharded subclasses gather here."""
        for name, param in self.model.named_parameters():
            yield name, param.detach().cpu()

    def weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        owner = rank_world()[0] == 0  # replicas are identical: rank 0 sends for all
        bucket, size = [], 0
        for name, tensor in self.full_parameters():  # on every rank: sharded subclasses gather here
            if not owner:
                continue
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def save_checkpoint(self, path: str) -> None:
        if rank_world()[0] != 0:  # replicas are identical: rank 0 writes for all
            return
        root = Path(path)
        self.model.save_pretrained(root / "model", safe_serialization=True)
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state()},
            root / "train_state.pt",
        )

    def load_checkpoint(self, path: str) -> None:
        root = Path(path)
        # from_pretrained resolves tied weights and shards the same way it does for any checkpoint.
        self.model.load_state_dict(_load_model(str(root / "model")).state_dict())
        state = torch.load(root / "train_state.pt", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])


class HFCriticStrategy(_Optimizing, _Offloading, CriticStrategy):
    """PPO's value model: the policy checkpoint loaded as ``AutoModelForTokenClassification`` with one
    label, so the backbone starts from the policy and a fresh linear head gives ``V(s_t)`` per token.
    Checkpoints stay plain Hugging Face directories."""

    metric_prefix = "critic"

    def __init__(self, model_path: str, role_config, run_config, seed: int):
        from transformers import AutoModelForTokenClassification

        self.role_config, self.run_config = role_config, run_config
        self.device = _device()
        # The new head is initialised from the global RNG: fork it so the driver's RNG (local
        # executor) is untouched and the head is the same for a given seed in any executor.
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the "score head newly initialised" report is expected
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.model = AutoModelForTokenClassification.from_pretrained(
                    model_path, num_labels=1, dtype=torch.float32).to(self.device)
        finally:
            hf_logging.set_verbosity(verbosity)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=role_config.lr,
                                           weight_decay=role_config.weight_decay)

    def _to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def _values(self, batch: Batch) -> torch.Tensor:
        ids, mask = _full_sequence(batch)
        ids, mask = self._to(ids), self._to(mask)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
        width = batch["responses"].shape[1]
        # V(s_t) is read where the log-prob of token t is: at the position before it.
        return out.logits[:, -width - 1 : -1, 0].float() * self._to(batch["response_mask"]).float()

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        self.model.eval()
        return self._values(batch).cpu()

    def micro_loss(self, micro: Batch, tokens: float, seqs: float):
        return critic_loss(self._values(micro), micro, self.run_config.algorithm, global_tokens=tokens,
                           global_seqs=seqs, max_response_length=self.run_config.rollout.max_new_tokens)

    def train_step(self, batch: Batch) -> dict[str, float]:
        return self.optimize(batch)

    def save_checkpoint(self, path: str) -> None:
        if rank_world()[0] != 0:
            return
        root = Path(path)
        self.model.save_pretrained(root / "model", safe_serialization=True)
        torch.save({"optimizer": self.optimizer.state_dict()}, root / "train_state.pt")

    def load_checkpoint(self, path: str) -> None:
        from transformers import AutoModelForTokenClassification

        root = Path(path)
        loaded = AutoModelForTokenClassification.from_pretrained(root / "model", dtype=torch.float32)
        self.model.load_state_dict(loaded.state_dict())
        self.optimizer.load_state_dict(torch.load(root / "train_state.pt", weights_only=False)["optimizer"])

