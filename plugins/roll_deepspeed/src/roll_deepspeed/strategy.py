"""``deepspeed``: the ``hf`` strategies' model and losses, trained by a DeepSpeed ZeRO engine.

The model is the one ``hf`` loads (so log-probs agree with it to float rounding), wrapped by
``deepspeed.initialize`` with torch's AdamW, the optimizer of roll's other backends (fused, as
theirs, where torch's kernel takes the parameters). Everything the
update needs maps onto the engine:

* ``forward_backward``: forward through the engine (ZeRO's hooks), ``engine.backward`` per
  micro-batch. DeepSpeed *averages* gradients over data-parallel ranks while roll's losses are
  already divided by global denominators and must be *summed*, so each micro-batch loss is scaled
  by the data-parallel size before backward.
* ``apply_gradients``: one ``engine.step()``, the accumulation boundary (DeepSpeed's unmanaged
  accumulation mode): gradients are reduced, their global norm is taken, they are clipped to
  ``max_norm`` and applied; a non-finite norm makes ZeRO drop the step. The norm it took is returned.
* Phases (the supervised warm-up's optimizer, then the RL one): DeepSpeed has one optimizer per
  engine, so a new phase resets its moments and settings, as a fresh AdamW would start.
* Weights for the sync and the Hugging Face export: replicated under stages 1-2 (rank 0 sends),
  gathered parameter by parameter under stage 3 (every rank takes part, rank 0 keeps them).
* Checkpoints: DeepSpeed's own (every rank's optimizer partition, so a resumed run continues
  exactly) next to the Hugging Face model directory the pipeline exports.
* Colocation: ``engine.offload_states()`` / ``reload_states()`` on a GPU; nothing to free on CPU.
* LoRA (``roles.actor_train.lora``): peft wraps the model before the engine does, so ZeRO holds
  optimizer state for the adapters alone; syncs, exports and the warm-up's fold run on the wrapped
  model (``self.module``), as under ``hf``, reading and writing whole weights through
  :class:`ZeRO3Parameters` under stage 3 (which also partitions the frozen base). A fold writes
  fresh adapters into the model, so the engine's fp32 master copies are refreshed from it;
  checkpoints hold ``adapter/`` (peft's format) beside the engine's own. The critic's LoRA
  (``roles.critic.lora``: adapters, and the value head trained whole) takes the same paths.

Use it: ``roles.actor_train.strategy=deepspeed roles.actor_train.num_workers=2
roles.actor_train.strategy_options.zero_stage=3``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from roll_core.runtime.distributed import default_backend, ensure_process_group, rank_world
from roll_core.strategies import lora
from roll_core.strategies.engines import check_engine_version, import_engine
from roll_core.strategies.hf import HFCriticStrategy, HFTrainStrategy
from roll_core.strategies.sharded import TENSORS, WholeParameters
from roll_deepspeed import SUPPORTED_DEEPSPEED
from roll_deepspeed.options import DeepSpeedOptions


def _deepspeed() -> Any:
    deepspeed = import_engine("deepspeed", "pip install roll-deepspeed")
    check_engine_version("DeepSpeed", deepspeed.__version__, SUPPORTED_DEEPSPEED, "roll-deepspeed")
    return deepspeed


def _without_shared_memory_op() -> None:
    """Keep ``deepspeed.init_distributed`` from compiling its shared-memory all-reduce. On a CPU it
    builds that C++ op (``deepspeed_shm_comm``) with ninja the first time a machine runs it, about a
    minute on 2 cores, and again whenever the compiler's command line changes; only DeepSpeed's
    inference all-reduce calls it, and training's collectives are torch's (gloo here). DeepSpeed skips
    ops its table of compatible ops marks false, a table that lives in ``deepspeed.ops`` for the
    process (probed once, in 0.1 s), so the op is marked false there."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class ZeRO3Parameters(WholeParameters):
    """Whole values of ZeRO-3's parameters: each rank holds a partition (``ds_tensor``) beside an
    empty placeholder. ``GatheredParameters`` assembles the whole on every rank for its duration,
    and with a ``modifier_rank`` partitions what that rank holds when it ends (every rank writes the
    same value here). Tensors ZeRO does not manage are read and written as plain ones."""

    def read(self, param: torch.Tensor) -> torch.Tensor:
        if not hasattr(param, "ds_id"):
            return super().read(param)
        with _deepspeed().zero.GatheredParameters([param]):
            return param.detach().clone()  # a copy: the gathered storage is released, or reused, after

    def write(self, param: torch.Tensor, value: torch.Tensor) -> None:
        if not hasattr(param, "ds_id"):
            return super().write(param, value)
        with _deepspeed().zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            param.copy_(value.to(param.dtype))

    def shape(self, param: torch.Tensor) -> torch.Size:
        return param.ds_shape if hasattr(param, "ds_id") else param.shape


class _ZeROEngine:
    """The engine primitives on a DeepSpeed engine, for any ``hf`` strategy that builds
    ``self.model`` and then calls ``_build_optimizers`` (the policy and the value model).

    After construction ``self.model`` is the engine (forward passes go through ZeRO's hooks) and
    ``self.module`` the Hugging Face model inside it."""

    model: Any
    device: torch.device
    role_config: Any
    generator: torch.Generator
    _new_optimizer: Any  # TorchPrimitives' (the hf strategy this is mixed into)
    whole_parameters: WholeParameters = TENSORS  # ZeRO3Parameters once stage 3 partitions them

    def autocast_precision(self, role_config) -> str:
        """No autocast around the engine: its own ``precision`` (DeepSpeedOptions) casts the model."""
        return "fp32"

    def _build_optimizers(self) -> None:
        deepspeed = _deepspeed()
        # DeepSpeed's ZeRO calls torch's collectives by their deprecated names, a FutureWarning per
        # call site in every worker of every run that nothing in a run's config can change
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            warnings.filterwarnings("ignore", message=f"`torch.distributed.{name}` is deprecated",
                                    category=FutureWarning)
        self.options = DeepSpeedOptions.model_validate(getattr(self.role_config, "strategy_options", {}) or {})
        ensure_process_group()
        # A worker sees only its own devices (Ray maps them), so its device is the first: local rank 0.
        os.environ.setdefault("LOCAL_RANK", "0")
        _without_shared_memory_op()
        deepspeed.init_distributed(dist_backend=default_backend())  # adopts the role's group
        self.module = self.model
        # hf's AdamW (on torch's fused kernel where it takes the parameters); ZeRO swaps in its flat
        # partitions, plain fp32 tensors on one device, which the fused kernel takes as well
        optimizer = self._new_optimizer(lr=self.role_config.lr, weight_decay=self.role_config.weight_decay)
        self.engine, *_ = deepspeed.initialize(model=self.module, optimizer=optimizer,
                                               config=self.options.deepspeed_config(self.device.type == "cuda"),
                                               dist_init_required=False)
        self.model = self.engine
        if self.options.zero_stage == 3:
            self.whole_parameters = ZeRO3Parameters()
        self.optimizers: dict[str, Any] = {}  # one optimizer, the engine's (see _start_phase)
        self._phase = "default"

    # -- the engine primitives ----------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed averages over the data-parallel ranks; roll's per-rank losses are summed.
        self.engine.backward(loss * self.data_parallel()[1], scale_wrt_gas=False)

    def reduce_gradients(self) -> None:
        """The engine reduces at its step (unmanaged accumulation)."""

    def apply_gradients(self, max_norm: float, optimizer: str = "default", lr: float | None = None) -> float:
        if optimizer != self._phase:
            self._start_phase(optimizer, lr)
        if lr is not None:
            self._set(lr=lr)
        self.engine.optimizer.clip_grad = max_norm
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def _start_phase(self, name: str, lr: float | None) -> None:
        """A new optimizer phase: fresh moments, and the settings of a new AdamW (the role's for
        ``default``, AdamW's defaults with ``lr`` for any other), as ``hf`` creates one per phase."""
        if name == "default":
            settings = {"lr": self.role_config.lr, "weight_decay": self.role_config.weight_decay}
        else:
            settings = {"lr": lr or self.role_config.lr}
        fresh = torch.optim.AdamW([torch.zeros(1)], **settings).defaults
        self.engine.optimizer.optimizer.state.clear()  # torch's AdamW re-creates its moments on the next step
        self._set(**{k: fresh[k] for k in ("lr", "weight_decay", "betas", "eps")})
        self._phase = name

    def _set(self, **settings) -> None:
        for group in self.engine.optimizer.optimizer.param_groups:
            group.update(settings)

    # -- weights ------------------------------------------------------------------------------
    def _plain_model_state(self) -> dict[str, torch.Tensor]:
        return dict(self.full_parameters())  # on every rank: stage 3 gathers (export_model: rank 0 writes)

    # -- colocation ---------------------------------------------------------------------------
    def offload(self) -> None:
        if self.device.type != "cpu" and not self.options.offload_params:
            self.engine.offload_states()

    def reload(self) -> None:
        if self.device.type != "cpu" and not self.options.offload_params:
            self.engine.reload_states()

    # -- checkpoints --------------------------------------------------------------------------
    def fold_adapters(self, base_path: str) -> None:
        """LoRA: as ``hf`` folds, then the engine's fp32 master copies of the adapters take the fresh
        ones (the optimizer's next step would otherwise write the old adapters back)."""
        super().fold_adapters(base_path)  # type: ignore[misc]  # the hf train strategy's
        self.engine.optimizer.refresh_fp32_params()

    def save_checkpoint(self, path: str) -> None:
        """``model/`` (Hugging Face, written by rank 0; under LoRA ``adapter/``, and ``model/`` merged
        with ``save: merged``), ``deepspeed/`` (the engine's checkpoint: module, every rank's optimizer
        partition) and ``rng_rank<r>.pt`` per rank."""
        root = Path(path)
        rank = rank_world()[0]
        adapted = getattr(self, "lora", None)
        if adapted is not None:
            adapter = lora.adapter_state(self.module, self.whole_parameters)  # every rank takes part
            if rank == 0:
                lora.save_adapter(self.module, root / "adapter", adapter)
        if adapted is None or adapted.save == "merged":
            self.export_model(str(root / "model"))
        self.engine.save_checkpoint(str(root / "deepspeed"), tag="state", save_latest=False)
        torch.save({"generator": self.generator.get_state() if hasattr(self, "generator") else None,
                    "phase": self._phase}, root / f"rng_rank{rank}.pt")
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        root = Path(path)
        if getattr(self, "lora", None) is not None:
            # the base the adapters were trained on (a folded warm-up's) and its name; the engine's
            # checkpoint then restores every weight and the optimizer exactly
            lora.load_adapter(self.module, root / "adapter", self.whole_parameters)
        loaded, _ = self.engine.load_checkpoint(str(root / "deepspeed"), tag="state", load_optimizer_states=True,
                                                load_lr_scheduler_states=False)
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {root / 'deepspeed'}")
        state = torch.load(root / f"rng_rank{rank_world()[0]}.pt", weights_only=False)
        if state["generator"] is not None:
            self.generator.set_state(state["generator"])
        self._phase = state["phase"]


class DeepSpeedTrainStrategy(_ZeROEngine, HFTrainStrategy):
    """The policy on DeepSpeed ZeRO (``roles.actor_train.strategy: deepspeed``)."""

    # the engine's parameters (partitioned under stage 3): full_parameters reads each whole through
    # whole_parameters, on every rank, and no inference engine computes with them in place
    holds_whole_parameters = False


class DeepSpeedCriticStrategy(_ZeROEngine, HFCriticStrategy):
    """PPO's value model on DeepSpeed ZeRO (``roles.critic.strategy: deepspeed``)."""
