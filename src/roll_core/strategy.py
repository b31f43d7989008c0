"""Interfaces of training and inference strategies (backends).

A strategy owns one model replica inside one worker. Workers call it; the pipeline never does.
``hf`` (transformers + torch) is the built-in; ``vllm``/``sglang`` (inference) and
``deepspeed``/``megatron``/``fsdp2`` (training) plug in by registering under the same interfaces.

Tensor layout is the one of :mod:`roll_core.strategies.sequences`: left-padded prompts ``[B, P]``,
right-padded responses ``[B, R]``.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from typing import Any, Iterator

import torch

from roll_core.data import Batch


def request_cancelled() -> bool:
    """True inside a ``generate`` call that the scheduler has aborted (``Executor.cancel``).

    Engines check it between decoding steps and stop early, so an aborted request frees its worker
    at once instead of decoding samples nobody will train on. Outside a Ray worker it is always False
    (the ``local`` executor runs every call to completion before returning)."""
    ray = sys.modules.get("ray")  # never import Ray just to learn that it is not running
    if ray is None or not ray.is_initialized():
        return False
    try:
        return bool(ray.get_runtime_context().is_canceled())
    except RuntimeError:  # the driver, or no task running
        return False


class Colocatable:
    """Colocated roles time-share devices: the pipeline calls ``offload`` on a role before an
    overlapping role runs and ``reload`` before it runs again (see :mod:`roll_core.runtime.placement`).
    The defaults do nothing, which is right for strategies on CPU."""

    def offload(self) -> None:
        """Move model (and optimizer) states off the device."""

    def reload(self) -> None:
        """Inverse of :meth:`offload`."""


class InferStrategy(Colocatable, ABC):
    """Generation and log-probs. Constructed as ``cls(model_path, role_config, run_config, seed)``."""

    #: An engine that batches concurrent requests itself (continuous batching, as vLLM and SGLang
    #: do) sets this: its workers then run up to ``rollout.max_running_requests`` calls at once
    #: (threads of one Ray actor), so a short request returns while a long one still decodes.
    #: Calls are then no longer ordered on the worker: ``begin_update`` must wait for the requests
    #: already running and hold back new ones until ``end_update``.
    concurrent_requests: bool = False

    @abstractmethod
    def generate(self, batch: Batch, *, max_new_tokens: int, temperature: float, top_p: float) -> Batch:
        """Add ``responses``, ``response_mask`` and ``infer_log_probs`` ``[B, R]`` to ``batch``
        (which carries ``prompt_ids`` and ``prompt_mask``) and return it. ``temperature=0`` is greedy.
        An engine should stop early once :func:`request_cancelled` is true (the result is discarded)."""

    @abstractmethod
    def compute_log_probs(self, batch: Batch, temperature: float, distribution: bool = False) -> torch.Tensor:
        """Log-probs ``[B, R]`` of ``batch['responses']`` given the prompts; with ``distribution``
        the full log-softmax ``[B, R, V]`` (for KL estimators registered with ``distribution=True``)."""

    # -- the weight-update protocol (roll_core.runtime.weight_sync) -------------------------------
    def begin_update(self, version: int) -> None:
        """A weight update starts (``version`` counts updates). An engine may pause generation here;
        with ``concurrent_requests``, it must let running requests finish and hold new ones back."""

    @abstractmethod
    def load(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket of named parameters (Hugging Face names, full tensors) into the model."""

    def end_update(self) -> None:
        """Every bucket of the update is loaded: drop cached prefixes computed with the old weights
        and resume generation."""

    def rng_state(self) -> Any:
        """Sampling RNG state, saved in checkpoints so a resumed run draws the same samples."""
        return None

    def set_rng_state(self, state: Any) -> None:
        pass


class TrainStrategy(Colocatable, ABC):
    """Forward/backward/optimizer. Constructed as ``cls(model_path, role_config, run_config, seed)``.

    With ``num_workers > 1`` the strategy is built after its worker joined the role's
    ``torch.distributed`` group (:mod:`roll_core.runtime.distributed`); every rank gets an equal
    share of each mini-batch and must sum loss denominators and gradients over the ranks. Every
    method is called on every rank, so strategies that shard weights may use collectives anywhere."""

    @abstractmethod
    def compute_log_probs(self, batch: Batch, temperature: float, distribution: bool = False) -> torch.Tensor:
        """Log-probs ``[B, R]`` of the responses under the current weights (no gradient); with
        ``distribution`` the full log-softmax ``[B, R, V]``."""

    @abstractmethod
    def train_step(self, batch: Batch) -> dict[str, float]:
        """Policy update on ``batch``: ``algorithm.ppo_epochs`` passes of one optimizer step per
        ``algorithm.ppo_mini_batch_size`` samples, loss from :func:`roll_core.algorithms.objective.actor_loss`
        with denominators counted per mini-batch (:func:`~roll_core.algorithms.objective.loss_denominators`)."""

    @abstractmethod
    def sft_step(self, batch: Batch, lr: float) -> dict[str, float]:
        """One supervised step: cross-entropy on ``responses`` where ``response_mask`` is 1."""

    @abstractmethod
    def weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The weights this rank owns, full (unsharded) and under Hugging Face names, as buckets of
        ``(name, tensor)`` of about ``bucket_bytes`` each. Called on every rank at once (gathering
        collectives are allowed); a rank that owns nothing (a data-parallel replica other than
        rank 0) yields nothing. Every name must be yielded by exactly one rank."""

    @abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Model (Hugging Face format, safetensors), optimizer and RNG state under ``path``
        (called on every rank; the files must be complete when every rank has returned)."""

    @abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Inverse of :meth:`save_checkpoint`."""


class CriticStrategy(Colocatable, ABC):
    """PPO's value model. Constructed as ``cls(model_path, role_config, run_config, seed)``."""

    @abstractmethod
    def compute_values(self, batch: Batch) -> torch.Tensor:
        """``V(s_t)`` ``[B, R]`` for every response token (the state before the token), 0 on padding."""

    @abstractmethod
    def train_step(self, batch: Batch) -> dict[str, float]:
        """Regress on ``batch['returns']`` with :func:`roll_core.algorithms.objective.critic_loss`."""

    @abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Model (Hugging Face format) and optimizer state under ``path``."""

    @abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Inverse of :meth:`save_checkpoint`."""
