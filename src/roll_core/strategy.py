"""Interfaces of training and inference strategies (backends).

A strategy owns one model replica inside one worker. Workers call it; the pipeline never does.
``hf`` (transformers + torch) is the built-in; ``vllm``/``sglang`` (inference) and
``deepspeed``/``megatron``/``fsdp2`` (training) plug in by registering under the same interfaces.

Tensor layout is the one of :mod:`roll_core.strategies.sequences`: left-padded prompts ``[B, P]``,
right-padded responses ``[B, R]``.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Collection, Iterator

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
    """What a strategy holds on its devices and host. Colocated roles time-share devices: the
    pipeline calls ``offload`` on a role before an overlapping role runs and ``reload`` before it
    runs again (see :mod:`roll_core.runtime.placement`). The defaults do nothing, which is right for
    strategies on CPU. ``close`` gives everything up when the worker stops."""

    def offload(self) -> None:
        """Move model (and optimizer) states off the device."""

    def reload(self) -> None:
        """Inverse of :meth:`offload`."""

    def close(self) -> None:
        """Release what garbage collection alone would not: an engine's threads, its child
        processes, memory a library keeps out of the collector's reach. The ``local`` executor's
        workers live in the driver, which may go on to start another run (a notebook, a test
        session): they call it once, when the run ends or the worker is replaced, and nothing is
        called on the strategy afterwards. A Ray worker is asked to close when the run ends (or
        before a restart), within a deadline, and then its process ends; a replaced one (hung) just
        ends. The default does nothing: a strategy holding tensors and modules only is freed with
        its last reference."""


class InferStrategy(Colocatable, ABC):
    """Generation and log-probs. Constructed as ``cls(model_path, role_config, seed)``."""

    #: An engine that batches concurrent requests itself (continuous batching, as vLLM and SGLang
    #: do) sets this: its workers then run up to ``rollout.max_running_requests`` calls at once
    #: (threads of one Ray actor), so a short request returns while a long one still decodes.
    #: Calls are then no longer ordered on the worker: ``begin_update`` must wait for the requests
    #: already running and hold back new ones until ``end_update``.
    concurrent_requests: bool = False

    #: A strategy whose workers hold one model between them (tensor or pipeline parallelism, as
    #: ``megatron``'s log-prob strategy) sets this: the role's workers then join one process group,
    #: as a trained role's do, and report their data-parallel ranks (a ``data_parallel()`` method),
    #: so log-probs go to each replica once.
    sharded: bool = False

    @abstractmethod
    def generate(self, batch: Batch, *, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int = 0) -> Batch:
        """Add ``responses``, ``response_mask`` and ``infer_log_probs`` ``[B, R]`` to ``batch``
        (which carries ``prompt_ids`` and ``prompt_mask``) and return it. ``temperature=0`` is greedy;
        otherwise each token is drawn from ``softmax(logits / temperature)`` cut to its ``top_k``
        heaviest tokens (0: no cut), then to the nucleus of ``top_p`` of what is left.
        ``infer_log_probs`` are the drawn tokens' log-probs at the temperature before either cut, as
        the trainer computes them. A response ends with the first id of
        :func:`~roll_core.strategies.sequences.response_end_ids` it draws (the tokenizer's EOS and
        the model files' end ids), which it keeps. An engine should stop early once
        :func:`request_cancelled` is true (the result is discarded)."""

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

    def can_share(self, parameters: dict[str, torch.Tensor]) -> bool:
        """Whether :meth:`share` can take ``parameters`` (a trainer's own tensors in this process, by
        Hugging Face name) as the model's weights. False, the default: the engine keeps a copy of its
        own and gets :meth:`load`."""
        return False

    def share(self, parameters: dict[str, torch.Tensor]) -> None:
        """Compute with ``parameters`` from now on instead of a copy (called where :meth:`can_share`
        is true, between ``begin_update`` and ``end_update``). The hybrid engine's weight sync does
        this; its rollouts never overlap an update, so the weights change only while the engine is
        idle (:class:`roll_core.runtime.weight_sync.InProcessSync`)."""
        raise NotImplementedError(f"{type(self).__name__} keeps its own weights (can_share is False)")

    def rng_state(self) -> Any:
        """Sampling RNG state, saved in checkpoints so a resumed run draws the same samples."""
        return None

    def set_rng_state(self, state: Any) -> None:
        pass


class Trainable(Colocatable, ABC):
    """The engine primitives of a trained model. The update loop (epochs, mini-batches, clipping,
    skipping non-finite steps, metrics) is the core's (:func:`roll_core.training.update`), the loss
    a function passed in (:mod:`roll_core.algorithms.objective`), so a strategy only runs its model.

    Constructed as ``cls(model_path, role_config, seed)``: its role's section of the config only.
    With ``num_workers > 1`` it is built after its worker joined the role's ``torch.distributed``
    group (:mod:`roll_core.runtime.distributed`); every method is called on every rank, so a
    strategy that shards weights may use collectives anywhere."""

    def data_parallel(self) -> tuple[int, int]:
        """``(rank, size)`` of this worker among the role's data-parallel replicas: each gets an equal
        share of every mini-batch. A strategy with tensor or pipeline parallelism returns its data-
        parallel coordinates, not its rank in the whole group."""
        from roll_core.runtime.distributed import rank_world

        return rank_world()

    def data_parallel_group(self) -> Any:
        """The ``torch.distributed`` group of this worker's data-parallel replicas, over which loss
        denominators and metrics are summed; None (the default) is the role's whole group."""
        return None

    @abstractmethod
    def forward(self, batch: Batch, outputs: Collection[str], temperature: float) -> dict[str, torch.Tensor]:
        """A forward pass without gradient: the ``outputs`` asked for, on CPU, zero on padding.
        Names: ``log_probs`` ``[B, R]`` (of ``responses`` given the prompts, logits divided by
        ``temperature``), ``entropy`` ``[B, R]``, ``log_dist`` ``[B, R, V]`` (full log-softmax),
        ``values`` ``[B, R]`` (a value model's ``V(s_t)``)."""

    @abstractmethod
    def forward_backward(self, mini: Batch, loss_fn: Any, *, micro_batch_size: int,
                         denominators: tuple[float, float]) -> list[dict[str, float]]:
        """Accumulate the gradients of ``loss_fn`` over ``mini`` in micro-batches of at most
        ``micro_batch_size``: for each, run the forward pass for ``loss_fn.outputs`` at
        ``loss_fn.temperature`` (with gradient), call ``loss_fn(outputs, micro, *denominators)``
        for ``(loss, metrics)`` and back-propagate. The gradients are summed over the data-parallel
        ranks on return, or (an engine that reduces at its optimizer step) by the time
        :meth:`apply_gradients` clips them. Returns each micro-batch's metrics."""

    def apply_gradients(self, max_norm: float, optimizer: str = "default", lr: float | None = None) -> float:
        """Clip the accumulated gradients to the global norm ``max_norm``, then apply them with
        ``optimizer`` if that norm is finite, or drop them if it is not (a NaN loss never reaches
        the weights). Returns the norm before clipping, the same on every rank (NaN or inf when the
        loss was).

        ``optimizer``: ``default`` is the role's (``lr``, ``weight_decay``); another name gets an
        optimizer of its own, created on first use, so a phase (the supervised warm-up) does not
        carry its moments into the next. ``lr`` sets its learning rate.

        The default composes :meth:`clip_gradients`, :meth:`optimizer_step` and :meth:`zero_grad`.
        Engines whose optimizer clips and skips in one call (DeepSpeed's ZeRO optimizers, Megatron's
        distributed optimizer) override this instead of those two."""
        norm = self.clip_gradients(max_norm)
        if math.isfinite(norm):
            self.optimizer_step(optimizer, lr)
        else:
            self.zero_grad()
        return norm

    def clip_gradients(self, max_norm: float) -> float:
        """Clip the global gradient norm to ``max_norm``; returns the norm before clipping (the
        same on every rank). Needed only by the default :meth:`apply_gradients`."""
        raise NotImplementedError(f"{type(self).__name__} implements neither apply_gradients nor clip_gradients")

    def optimizer_step(self, optimizer: str = "default", lr: float | None = None) -> None:
        """Apply the gradients with optimizer ``optimizer`` (see :meth:`apply_gradients`). Needed
        only by the default :meth:`apply_gradients`."""
        raise NotImplementedError(f"{type(self).__name__} implements neither apply_gradients nor optimizer_step")

    @abstractmethod
    def zero_grad(self) -> None:
        """Drop the accumulated gradients."""

    @abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Model (Hugging Face format, safetensors), optimizer and RNG state under ``path``
        (called on every rank; the files must be complete when every rank has returned)."""

    @abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Inverse of :meth:`save_checkpoint`."""


class TrainStrategy(Trainable):
    """The trained policy: the engine primitives, plus its weights for the inference engines."""

    def compute_log_probs(self, batch: Batch, temperature: float, distribution: bool = False) -> torch.Tensor:
        """Log-probs ``[B, R]`` of the responses under the current weights; with ``distribution``
        the full log-softmax ``[B, R, V]``."""
        name = "log_dist" if distribution else "log_probs"
        return self.forward(batch, (name,), temperature)[name]

    @abstractmethod
    def weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The weights this rank owns, full (unsharded) and under Hugging Face names, as buckets of
        ``(name, tensor)`` of about ``bucket_bytes`` each. Called on every rank at once (gathering
        collectives are allowed); a rank that owns nothing (a data-parallel replica other than
        rank 0) yields nothing. Every name must be yielded by exactly one rank."""

    def export_model(self, directory: str) -> None:
        """The policy as a plain Hugging Face model directory (safetensors; under LoRA the adapters
        merged), written once by whichever rank writes it. Called on every rank (gathers are
        allowed); complete when every rank has returned. The supervised warm-up exports
        ``warm-model/`` with it.

        The default serves a strategy that can only save checkpoints: a whole checkpoint into a
        scratch directory beside ``directory``, whose ``model/`` rank 0 moves there once every rank
        has written. The built-in strategies write the model alone (no optimizer state to throw
        away) and a checkpoint's ``model/`` with the same method."""
        from roll_core.runtime.distributed import barrier, rank_world

        target = Path(directory)
        scratch = target.with_name(target.name + ".checkpoint")
        self.save_checkpoint(str(scratch))
        barrier()  # every rank's files are written
        if rank_world()[0] == 0:
            os.replace(scratch / "model", target)
            shutil.rmtree(scratch)
        barrier()

    def shared_parameters(self) -> dict[str, torch.Tensor] | None:
        """The model's own parameter tensors by Hugging Face name, for an inference engine in this
        process to compute with instead of a copy (:meth:`InferStrategy.share`). Only where they are
        whole tensors that the updates change in place, the names and shapes of :meth:`weight_buckets`;
        None, the default, anywhere else (sharded parameters, adapters merged on the way out)."""
        return None


class CriticStrategy(Trainable):
    """PPO's value model: the engine primitives with a ``values`` output."""

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """``V(s_t)`` ``[B, R]`` for every response token (the state before the token), 0 on padding."""
        return self.forward(batch, ("values",), 1.0)["values"]
