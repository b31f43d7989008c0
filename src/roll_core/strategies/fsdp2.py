"""``fsdp2``: the ``hf`` training and critic strategies with their model sharded by torch's FSDP2
(``fully_shard``).

Each decoder layer (the model's ``_no_split_modules``) and then the whole model become FSDP units
over the role's data-parallel group: parameters, gradients and Adam moments are split across the
workers, and each forward/backward gathers a unit's parameters only while it runs. It runs over
gloo on CPU processes (what the tests do here) and over nccl on GPUs.

The loss arithmetic is the ``hf`` strategy's: every rank scales its share by global denominators,
so FSDP2's reduce-scatter must *sum* gradients (divide factor 1), not average them. Full weights
(for weight sync and Hugging Face checkpoints) are gathered with collectives on every rank.

LoRA (``roles.actor_train.lora``, ``roles.critic.lora``) works as under ``hf``: peft wraps the model
before it is sharded, so the adapters are FSDP parameters too (trainable beside the frozen base in
the same units; a LoRA critic's value head in the root unit), and what reads or writes a whole
adapter or weight gathers or shards it (:mod:`roll_core.strategies.lora`).

The critic (PPO's value model, ``roles.critic.strategy: fsdp2``) is the ``hf`` critic's value model
sharded the same way; its checkpoints hold the same ``...ForTokenClassification`` ``model/``.

Use it: ``roles.actor_train.strategy=fsdp2 roles.actor_train.num_workers=2`` (and the same keys
under ``roles.critic``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Collection, Iterator

import torch
import torch.distributed as dist

from roll_core.data import Batch
from roll_core.runtime.distributed import ensure_process_group, rank_world
from roll_core.strategies import lora
from roll_core.strategies.hf import HFCriticStrategy, HFTrainStrategy


class _FSDP2Units:
    """What FSDP2 changes in an ``hf`` strategy, the policy's or the critic's: the model sharded in
    units before its optimizer is built, gradients summed by the units' reduce-scatter, and whole
    model and optimizer states gathered (every rank takes part) for checkpoints."""

    model: Any
    device: torch.device
    optimizers: dict[str, torch.optim.Optimizer]
    lora: Any
    # the hf strategy's (roll_core.strategies.hf.WholeCheckpoints), which this one gathers for
    export_model: Callable[[str], None]
    full_parameters: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    _plain_state: Callable[[str], dict[str, torch.Tensor]]
    _sampling_state: Callable[[], dict[str, Any]]
    _restore_sampling: Callable[[dict[str, Any]], None]

    def prepare_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        ensure_process_group()
        # FSDP2 warns at every pass whose output is a view (a value head's [B, T, 1], a linear with a
        # bias on flattened rows viewed back; an image-text model's logits): an in-place write on it
        # would skip FSDP's pre-backward hook. roll never writes in place on a model's outputs
        # (sequences.without makes a new tensor), so the warning would only alarm.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor",
                                category=UserWarning)
        mesh = init_device_mesh(self.device.type, (rank_world()[1],))
        unit_names = set(getattr(self.model, "_no_split_modules", None) or ())
        for module in self.model.modules():
            if type(module).__name__ in unit_names:
                fully_shard(module, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):  # the settings are per FSDP unit
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum

    def reduce_gradients(self) -> None:
        """FSDP2's reduce-scatter already summed the gradient shards during backward."""

    def forward(self, batch: Batch, outputs: Collection[str], temperature: float) -> dict[str, torch.Tensor]:
        """The ``hf`` pass without gradient, then the root unit resharded. FSDP2 keeps the root's
        parameters gathered after a forward, for the backward that follows in training; after a pass
        without one they stayed whole until the next update (a vocabulary-sized embedding and head
        held between phases), and ``named_parameters`` yielded tensors the optimizer does not hold,
        so the checkpoint of a role that trains root parameters (a LoRA critic's head) failed."""
        try:
            return super().forward(batch, outputs, temperature)  # type: ignore[misc]  # the hf strategy's
        finally:
            self.model.reshard()

    def _full_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _full_optimizer_state(self) -> dict[str, Any]:
        """The default optimizer's states, whole, on CPU (gathered: every rank calls it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizers["default"],
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _load_states(self, model_state: dict[str, Any] | None, optimizer_state: dict[str, Any]) -> None:
        """Whole model (None: leave it) and optimizer states, each rank keeping its shards."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        full = StateDictOptions(full_state_dict=True)
        if model_state is not None:
            set_model_state_dict(self.model, model_state, options=full)
        # not strict: a parameter that never had a gradient has no Adam state to save (SigLIP's pooling
        # head and last norm, which a LLaVA model never reads), and starts without one, as it was
        set_optimizer_state_dict(self.model, self.optimizers["default"], optim_state_dict=optimizer_state,
                                 options=StateDictOptions(full_state_dict=True, strict=False))

    def _plain_model_state(self) -> dict[str, Any]:
        # gathered on every rank (export_model: rank 0 writes it); under LoRA the adapters merged
        return dict(self.full_parameters()) if self.lora is not None else self._full_state_dict()

    def save_checkpoint(self, path: str) -> None:
        """As ``hf`` saves (:class:`~roll_core.strategies.hf.WholeCheckpoints`), every rank gathering
        the model, the adapters and the optimizer's states; rank 0 writes them."""
        root = Path(path)
        if self.lora is None or self.lora.save == "merged":
            self.export_model(str(root / "model"))
        adapter = lora.adapter_state(self.model) if self.lora is not None else None
        optim_state = self._full_optimizer_state()
        if rank_world()[0] == 0:
            if adapter is not None:
                lora.save_adapter(self.model, root / "adapter", adapter)
            torch.save({"optimizer": optim_state, **self._sampling_state()}, root / "train_state.pt")
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        root = Path(path)
        if self.lora is not None:
            lora.load_adapter(self.model, root / "adapter")
        model = None if self.lora is not None else self._plain_state(str(root / "model"))
        state = torch.load(root / "train_state.pt", weights_only=False)
        self._load_states(model, state["optimizer"])
        self._restore_sampling(state)


class FSDP2TrainStrategy(_FSDP2Units, HFTrainStrategy):
    """AdamW over FSDP2-sharded parameters (one shard per data-parallel rank)."""

    holds_whole_parameters = False  # DTensors: full_parameters gathers each (a collective)


class FSDP2CriticStrategy(_FSDP2Units, HFCriticStrategy):
    """PPO's value model with FSDP2-sharded parameters: the ``hf`` critic's model, passes and
    ``model/`` (``...ForTokenClassification``), the optimizer's states split over the ranks."""
