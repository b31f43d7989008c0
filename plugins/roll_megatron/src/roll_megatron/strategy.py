"""``megatron``: the policy (and PPO's critic, and a frozen reference) as a Megatron-Core ``GPTModel``
with tensor, pipeline and data parallelism.

A role of ``num_workers`` workers is laid out by Megatron's ``parallel_state`` as
``tensor_parallel_size x pipeline_parallel_size`` model-parallel ranks times ``num_workers / that``
data-parallel replicas. The weights come from the Hugging Face checkpoint (:mod:`roll_megatron.convert`)
and go back to Hugging Face names for the weight sync and the exported model.

The engine primitives, on any device (CPU over gloo here, GPUs over nccl):

* rows: each micro-batch (``micro_batch_size`` samples, or ``max_tokens_per_micro_batch`` tokens) is
  packed as the torch strategies pack it (:mod:`roll_core.strategies.packing`: no padding, a
  group's prompt once), unless ``pack_sequences: false``; every stage makes the same rows.
* ``forward`` / ``forward_backward``: each micro-batch goes through the pipeline stages in turn,
  hidden states sent forward and their gradients back with point-to-point ``send``/``recv`` (one
  micro-batch in flight; Megatron's interleaved schedules allocate on CUDA). The last stage gathers
  the vocabulary-parallel logits, computes roll's outputs and loss (the core's policy losses,
  unchanged) and broadcasts outputs and metrics to the other stages.
* gradients: summed over the data-parallel group (the loss is divided by global denominators); with
  tied embeddings split over stages, the two copies' gradients are summed over Megatron's embedding
  group, as Megatron does.
* precision: ``precision: bf16`` runs every stage's forward under bfloat16 autocast, as the ``hf``
  strategy's ``bf16`` does: products in bfloat16; weights, gradients and AdamW's moments float32; a
  stage's output cast back to float32 (the hidden states sent on, the logits roll's outputs read).
  On the CPU the backward runs under autocast too: Megatron's linear layers are autograd functions
  whose backward re-enters autocast on CUDA only (``custom_bwd(device_type="cuda")``), and would
  otherwise multiply a bfloat16 gradient by a float32 weight.
* the global gradient norm counts tensor-parallel shards once each, replicated parameters (norms)
  once, and every stage's layers; clipping and torch's AdamW act on each rank's shards.
* weights: each stage's tensor-parallel shards are all-gathered and converted to Hugging Face
  names; data-parallel rank 0, tensor rank 0 of every stage yields them, so each name comes from
  exactly one rank.

The critic is the same model with a one-label value head for an output layer, whole on every
tensor-parallel rank (:class:`~roll_megatron.model.ValueHead`): its ``values`` need no vocabulary
gathered, and its ``model/`` is the ``...ForTokenClassification`` directory the ``hf`` critic writes.
Under ``roles.critic.lora`` its head trains whole beside the adapters, as the ``hf`` critic's does.

Use it: ``roles.actor_train.strategy=megatron roles.actor_train.num_workers=2
roles.actor_train.strategy_options.tensor_parallel_size=2``; for the critic, the same keys under
``roles.critic``.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterator

import torch
import torch.distributed as dist

from roll_core.data import Batch
from roll_core.runtime.distributed import bucketed, ensure_process_group, rank_world
from roll_core.strategies import lora as core_lora
from roll_core.strategies import precision as mixed
from roll_core.strategies.engines import check_engine_version, import_engine
from roll_core.strategies.hf import TorchOffloading, TorchPrimitives, fused_adamw
from roll_core.strategies.models import (VALUE_HEAD, default_device, fresh_value_head, full_sequence,
                                         safetensors_files)
from roll_core.strategies.packing import PackedSequences, pack_batch
from roll_core.strategies.sequences import response_outputs
from roll_core.strategy import CriticStrategy, InferStrategy, TrainStrategy
from roll_core.training import micro_batches
from roll_megatron import SUPPORTED_MEGATRON
from roll_megatron import lora as megatron_lora
from roll_megatron.convert import Layout
from roll_megatron.model import attention_mask, build_gpt_model, gather_vocabulary, positions_in, transformer_config
from roll_megatron.options import MegatronOptions


def _parallel_state(options: MegatronOptions) -> Any:
    """Megatron's process groups for this role, created once per worker process."""
    if not torch.cuda.is_available():  # Megatron's advice on CUDA kernels, of no use to a CPU run
        for advice in (".*Apex (is|are) not installed", ".*CUDA_DEVICE_MAX_CONNECTIONS", "full scope is deprecated"):
            warnings.filterwarnings("ignore", message=advice)
    megatron = import_engine("megatron.core", "pip install roll-megatron")
    check_engine_version("megatron-core", megatron.__version__, SUPPORTED_MEGATRON, "roll-megatron")
    from megatron.core import parallel_state

    ensure_process_group()
    if not parallel_state.model_parallel_is_initialized():
        world = rank_world()[1]
        if world % options.model_parallel_size:
            raise ValueError(f"{options.model_parallel_size} model-parallel ranks do not divide {world} workers")
        parallel_state.initialize_model_parallel(options.tensor_parallel_size, options.pipeline_parallel_size)
    return parallel_state


def hf_tensors(model_path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face checkpoint's safetensors files (one file or an index)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_path):
        tensors.update(load_file(str(path)))
    return tensors


@dataclass(frozen=True)
class _Rows:
    """A micro-batch as the model takes it: token ids ``[N, W]``, Megatron's attention mask
    ``[N, 1, W, W]`` (``True`` = masked out), and the packing that made them (None: padded rows, or
    the warm-up's demonstrations, each row's own layout)."""

    ids: torch.Tensor
    mask: torch.Tensor
    packed: PackedSequences | None

    @property
    def positions(self) -> torch.Tensor | None:
        """Each token's rotary position ``[N, W]`` on packed rows, where a response follows another
        one; None elsewhere: rotated by column, as only distances within one sample count there."""
        return None if self.packed is None else self.packed.position_ids

    def at_responses(self, per_position: torch.Tensor, micro: Batch) -> torch.Tensor:
        """``[N, W, ...]`` -> ``[B, R, ...]``: the values at the positions that predict each of
        ``micro``'s response tokens (on padded rows, the one before it)."""
        if self.packed is None:
            return per_position[:, -micro["responses"].shape[1] - 1:-1]
        return self.packed.at_responses(per_position)


class _MegatronModel(TorchOffloading):
    """A Hugging Face checkpoint as a Megatron-Core ``GPTModel`` sharded over the role's workers,
    with the pipelined forward pass and the weights back under Hugging Face names: what the trained
    policy, a frozen reference and the critic share. ``value_model``: the output layer is a value
    head (:class:`~roll_megatron.model.ValueHead`) whose output is ``values``, not logits."""

    value_model = False

    def __init__(self, model_path: str, role_config, seed: int):
        from transformers import AutoConfig

        self.role_config, self.seed = role_config, seed
        self.options = MegatronOptions.model_validate(getattr(role_config, "strategy_options", {}) or {})
        self.ps = ps = _parallel_state(self.options)
        self.device = default_device()
        if self.device.type == "cuda":
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.tp, self.pp = self.options.tensor_parallel_size, self.options.pipeline_parallel_size
        if self.options.precision == "bf16":
            # Under autocast Megatron's residual stream is bfloat16 and its RMSNorm weights float32:
            # torch then normalizes without its fused kernel and warns at each norm's first call. The
            # unfused norm gives the same numbers; the warning would appear in every bf16 run.
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight", category=UserWarning)
        self.config = transformer_config(self.hf_config, torch.float32, self.tp, self.pp)
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.tied = bool(self.hf_config.tie_word_embeddings) and not self.value_model
        per_stage = self.hf_config.num_hidden_layers // self.pp
        self.layout = Layout(self.config, ps.get_tensor_model_parallel_rank(), self.tp,
                             ps.get_pipeline_model_parallel_rank() * per_stage, value_head=self.value_model)
        self.model = build_gpt_model(self.hf_config, self.config, self.first, self.last, self.device,
                                     value_head=self.value_model)
        self._load_hf(model_path)

    def _load_hf(self, model_path: str) -> None:
        tensors = hf_tensors(model_path)
        if self.value_model and "score.weight" not in tensors:  # a policy's checkpoint: a fresh head
            head = fresh_value_head(self.hf_config.hidden_size, self.hf_config.initializer_range, self.seed)
            tensors |= {f"score.{name}": value for name, value in head.items()}

        def hf(name: str) -> torch.Tensor:
            if name == "lm_head.weight" and name not in tensors and self.tied:
                name = "model.embed_tokens.weight"  # the last stage's copy of tied embeddings
            return tensors[name]

        with torch.no_grad():  # the weights only: a LoRA model's adapters are not in the checkpoint
            for name, param in self.model.named_parameters():
                if not megatron_lora.is_adapter(name):
                    param.copy_(self.layout.to_megatron(megatron_lora.base_name(name), hf))

    # -- layout ------------------------------------------------------------------------------
    def data_parallel(self) -> tuple[int, int]:
        return self.ps.get_data_parallel_rank(), self.ps.get_data_parallel_world_size()

    def data_parallel_group(self) -> Any:
        return self.ps.get_data_parallel_group()

    # -- the pipeline ------------------------------------------------------------------------
    def _rows(self, micro: Batch) -> _Rows:
        """``micro`` as the model takes it: packed when the role packs sequences (``pack_sequences``
        on or unset), else padded; the warm-up's packed demonstrations (``warmup.packing``) as they
        come. Every stage makes the same rows from the same micro-batch."""
        if "position_ids" in micro:  # examples side by side, each restarting its positions at 0
            ids, positions = torch.cat([micro["prompt_ids"], micro["responses"]], 1), micro["position_ids"]
            example = (positions == 0).cumsum(-1)
            causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
            allowed = causal[None] & (example[:, :, None] == example[:, None, :])  # within its own example
            return _Rows(ids, ~allowed[:, None], None)
        if getattr(self.role_config, "pack_sequences", None) is False:
            ids, mask = full_sequence(micro)
            return _Rows(ids, attention_mask(mask), None)
        packed = pack_batch(micro, self.role_config, self.hf_config.pad_token_id)
        return _Rows(packed.input_ids, ~packed.attention_mask("sdpa", self.config.params_dtype), packed)

    def _stage_forward(self, rows: _Rows, received: torch.Tensor | None) -> torch.Tensor:
        """This stage's output for ``rows``: the output layer's ``[N, W, V / tp]`` (a value head's
        ``[N, W, 1]``) on the last stage, hidden states ``[W, N, H]`` on the others (``received`` is
        the previous stage's)."""
        ids = rows.ids.to(self.device)
        if not self.first:
            self.model.set_input_tensor(received)
        with positions_in(self.model, rows.positions), mixed.autocast(self.device, self.options.precision):
            out = self.model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=self.device).expand_as(ids),
                             attention_mask=rows.mask.to(self.device))
        return out.float()  # a no-op in fp32

    def _backward(self, tensor: torch.Tensor, gradient: torch.Tensor | None = None) -> None:
        """``tensor.backward(gradient)``; under bf16 on the CPU within autocast (see the module's docstring)."""
        with mixed.autocast(self.device, self.options.precision if self.device.type == "cpu" else "fp32"):
            tensor.backward(gradient)

    def _outputs(self, out: torch.Tensor, rows: _Rows, micro: Batch, outputs: Collection[str],
                 temperature: float) -> dict[str, torch.Tensor]:
        """roll's ``outputs`` for ``micro`` (its tensors on the device) from the last stage's ``out``
        over ``rows``, at the positions that predict each response token: a value model's
        ``values`` ``[B, R]`` (read there, as ``hf``'s critic reads them); else the log-probs, entropy
        or distributions of the responses from the gathered vocabulary."""
        if self.value_model:
            return {"values": rows.at_responses(out[..., 0], micro)}
        return response_outputs(rows.at_responses(gather_vocabulary(out), micro), micro["responses"], outputs,
                                temperature)

    def _on_device(self, batch: Batch) -> Batch:
        return Batch({k: v.to(self.device) for k, v in batch.tensors.items()}, batch.non_tensors)

    def _hidden_shape(self, rows: _Rows) -> tuple[int, int, int]:
        return (rows.ids.shape[1], rows.ids.shape[0], self.config.hidden_size)

    def _recv(self, shape, src: int) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=self.config.params_dtype, device=self.device)
        dist.recv(buffer, src=src)
        return buffer

    def _from_last_stage(self, value: Any) -> Any:
        """``value`` of the last stage, on every stage (an object: tensors travel pickled)."""
        if self.pp == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self.ps.get_pipeline_model_parallel_last_rank(),
                                   group=self.ps.get_pipeline_model_parallel_group())
        return box[0]

    @torch.no_grad()
    def forward(self, batch: Batch, outputs: Collection[str], temperature: float) -> dict[str, torch.Tensor]:
        self.model.eval()
        rows = self._rows(batch)
        received = None
        if not self.first:
            received = self._recv(self._hidden_shape(rows), self.ps.get_pipeline_model_parallel_prev_rank())
        out = self._stage_forward(rows, received)
        result = None
        if self.last:
            found = self._outputs(out, rows, self._on_device(batch), outputs, temperature)
            rmask = batch["response_mask"].to(self.device)
            result = {k: (v * (rmask[..., None] if v.dim() == 3 else rmask)).cpu() for k, v in found.items()}
        else:
            dist.send(out.contiguous(), dst=self.ps.get_pipeline_model_parallel_next_rank())
        return self._from_last_stage(result)

    def compute_log_probs(self, batch: Batch, temperature: float, distribution: bool = False) -> torch.Tensor:
        """Log-probs ``[B, R]`` of the responses (with ``distribution``, ``[B, R, V]``), on every rank."""
        name = "log_dist" if distribution else "log_probs"
        return self.forward(batch, (name,), temperature)[name]

    # -- weights -----------------------------------------------------------------------------
    def tp_shards(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """``tensor``'s counterparts on every tensor-parallel rank, in rank order (a collective)."""
        if self.tp == 1:
            return [tensor]
        shards = [torch.empty_like(tensor) for _ in range(self.tp)]
        dist.all_gather(shards, tensor.contiguous(), group=self.ps.get_tensor_model_parallel_group())
        return shards

    def hf_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's weights under Hugging Face names, tensor-parallel shards gathered (every
        tensor-parallel rank takes part and gets them); under LoRA, the adapters merged."""
        adapted = {f"{name}.base_layer.weight": layer for name, layer in megatron_lora.lora_layers(self.model)}
        for name, param in self.model.named_parameters():
            if megatron_lora.is_adapter(name):
                continue
            shard = param.detach()
            if name in adapted:
                shard = shard + adapted[name].delta_weight().detach()
            name = megatron_lora.base_name(name)
            if self.tied and name == "output_layer.weight":  # Hugging Face has no lm_head when tied
                continue
            shards = self.tp_shards(shard) if self.layout.is_split(name) else [shard]
            for hf_name, tensor in self.layout.to_hf(name, [s.cpu() for s in shards]):
                yield hf_name, tensor


class _MegatronTrainable(_MegatronModel, TorchPrimitives):
    """A trained model on Megatron-Core, the policy's and the critic's: the pipelined forward and
    backward passes, gradients reduced and clipped over the layout, the optimizers, and checkpoints
    (a Hugging Face ``model/`` and each rank's shards). Under the role's ``lora``, adapters on its
    parallel linear layers (:mod:`roll_megatron.lora`; the critic's value head trains whole beside them)."""

    def __init__(self, model_path: str, role_config, seed: int):
        super().__init__(model_path, role_config, seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.lora = getattr(role_config, "lora", None)
        if self.lora is not None:
            targets = self.lora.target_modules
            self.lora_targets = [p for p in megatron_lora.HF_PROJECTIONS if targets == "all-linear" or p in targets]
            self.lora_base = model_path  # the checkpoint under the adapters (a warm-up's fold moves it)
            megatron_lora.wrap(self.model, self.lora, self.config, self.tp, self.lora_targets)
            if self.value_model:
                megatron_lora.train_value_head(self.model)
            megatron_lora.fresh_adapters(self.model, seed, self.layout)
        self._build_optimizers()

    def _new_optimizer(self, **settings) -> torch.optim.Optimizer:
        """AdamW; with ``distributed_optimizer`` and several data-parallel replicas, torch's
        ``ZeroRedundancyOptimizer`` over the data-parallel group: each replica keeps the moments of
        its share of the parameters, steps them and broadcasts them (Megatron's own distributed
        optimizer allocates its buffers on CUDA). Either steps on torch's fused kernel where it takes
        the parameters, as ``hf`` does."""
        if not (self.options.distributed_optimizer and self.ps.get_data_parallel_world_size() > 1):
            return super()._new_optimizer(**settings)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        params = [p for p in self.model.parameters() if p.requires_grad]
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, fused=fused_adamw(params),
                                       process_group=self.ps.get_data_parallel_group(), **settings)

    def forward_backward(self, mini: Batch, loss_fn, *, micro_batch_size: int,
                         denominators: tuple[float, float]) -> list[dict[str, float]]:
        self.model.train()
        prev, nxt = self.ps.get_pipeline_model_parallel_prev_rank(), self.ps.get_pipeline_model_parallel_next_rank()
        per_micro = []
        max_tokens = getattr(self.role_config, "max_tokens_per_micro_batch", None)
        for micro in micro_batches(mini, micro_batch_size, max_tokens, self.data_parallel_group()):
            rows, received = self._rows(micro), None
            if not self.first:
                received = self._recv(self._hidden_shape(rows), prev).requires_grad_()
            out = self._stage_forward(rows, received)
            metrics = None
            if self.last:
                on_device = self._on_device(micro)
                found = self._outputs(out, rows, on_device, loss_fn.outputs, loss_fn.temperature)
                loss, metrics = loss_fn(found, on_device, *denominators)
                self._backward(loss)
            else:
                dist.send(out.detach().contiguous(), dst=nxt)
                self._backward(out, self._recv(out.shape, nxt))
            if received is not None:
                dist.send(received.grad.contiguous(), dst=prev)
            per_micro.append(self._from_last_stage(metrics))
        self.reduce_gradients()
        return per_micro

    def reduce_gradients(self) -> None:
        """Sum over data-parallel replicas; with tied embeddings split over stages, the embedding's
        and the output layer's gradients are one gradient (Megatron's embedding group)."""
        dp_group = self.ps.get_data_parallel_group()
        if self.ps.get_data_parallel_world_size() > 1:
            for param in self.model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=dp_group)
        if self.tied and self.pp > 1 and self.ps.is_rank_in_embedding_group():
            weight = self.model.shared_embedding_or_output_weight()
            if not weight.requires_grad:  # frozen under LoRA
                return
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            dist.all_reduce(weight.grad, group=self.ps.get_embedding_group())

    def _duplicate(self, name: str) -> bool:
        """The last stage's copy of tied embeddings (the first stage's counts for both)."""
        return self.tied and self.pp > 1 and not self.first and name == "output_layer.weight"

    def clip_gradients(self, max_norm: float) -> float:
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, param in self.model.named_parameters():
            if param.grad is None or self._duplicate(name):
                continue
            square = param.grad.double().pow(2).sum()
            if self._is_split(name):
                sharded += square
            else:
                replicated += square
        if self.tp > 1:
            dist.all_reduce(sharded, group=self.ps.get_tensor_model_parallel_group())
        total = sharded + replicated
        if self.pp > 1:
            dist.all_reduce(total, group=self.ps.get_pipeline_model_parallel_group())
        norm = math.sqrt(float(total))
        if math.isfinite(norm) and norm > max_norm:
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def _is_split(self, name: str) -> bool:
        """Whether parameter ``name`` holds this rank's tensor-parallel part (a norm, a LoRA factor
        kept whole, does not: its gradient counts once in the norm)."""
        if megatron_lora.is_adapter(name):
            return self.tp > 1 and megatron_lora.is_split(name)
        return self.layout.is_split(megatron_lora.base_name(name))

    # -- weights -----------------------------------------------------------------------------
    def _owner(self) -> bool:
        return self.ps.get_data_parallel_rank() == 0 and self.ps.get_tensor_model_parallel_rank() == 0

    def _gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self.tp_shards(tensor), dim)

    # -- checkpoints -------------------------------------------------------------------------
    def _on_rank0(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
        """Every stage's ``(name, tensor)`` pairs on global rank 0 (None elsewhere), one rank per
        stage contributing. Called on every rank: making the pairs gathers shards."""
        mine = dict(tensors)
        if not self._owner():
            mine = {}
        rank = rank_world()[0]
        stages = [None] * rank_world()[1] if rank == 0 else None
        dist.gather_object(mine, stages, dst=0)
        return {k: v for part in stages or [] for k, v in part.items()} if rank == 0 else None

    def export_model(self, directory: str) -> None:
        """The model as a plain Hugging Face directory (the policy's with LoRA's adapters merged; the
        critic's as ``...ForTokenClassification``), written by global rank 0 from every stage's
        weights. Called on every rank."""
        weights = self._on_rank0(self.hf_parameters())
        if weights is not None:
            self._save_hf(Path(directory), weights)
        dist.barrier()

    def save_checkpoint(self, path: str) -> None:
        """``model/`` (:meth:`export_model`; under LoRA with ``save: adapter``, ``adapter/`` in peft's
        format instead) and ``megatron/rank<r>.pt`` (this rank's shards, optimizers and RNG: an exact
        resume). Under LoRA the rank files hold the adapters' parts, not the frozen base: the
        adapter's config names the plain checkpoint the base is, which a resume reads."""
        root = Path(path)
        rank = rank_world()[0]
        if self.lora is None or self.lora.save == "merged":
            self.export_model(str(root / "model"))
        if self.lora is not None:
            state = self._on_rank0(megatron_lora.adapter_state(self.model, self.layout, self._gather).items())
            if state is not None:
                config = core_lora.peft_config(self.lora, self.lora_targets, self.lora_base,
                                               [VALUE_HEAD] if self.value_model else None)
                core_lora.write_adapter(root / "adapter", config, state)
        (root / "megatron").mkdir(parents=True, exist_ok=True)
        model = self.model.state_dict()
        if self.lora is not None:  # what trains: the adapters (and a critic's head), not the frozen base
            trained = self._trained_names()
            model = {name: value for name, value in model.items() if name in trained}
        torch.save({"model": model,
                    "optimizers": {name: _local(opt).state_dict() for name, opt in self.optimizers.items()},
                    "generator": self.generator.get_state()}, root / "megatron" / f"rank{rank}.pt")
        dist.barrier()

    def _trained_names(self) -> set[str]:
        """The parameters this rank trains: all, or under LoRA the adapters and a critic's value head."""
        return {name for name, param in self.model.named_parameters() if param.requires_grad}

    def _save_hf(self, directory: Path, weights: dict[str, torch.Tensor]) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        if self.value_model:  # one label, no dropout: what load_value_model reads back
            config = copy.deepcopy(self.hf_config)
            config.num_labels, config.classifier_dropout = 1, 0.0
            model = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [m for m in missing if not (self.tied and m == "lm_head.weight")]
        if missing or unexpected:
            raise RuntimeError(f"Megatron -> Hugging Face export: missing {missing}, unexpected {unexpected}")
        if self.tied:
            model.tie_weights()
        model.save_pretrained(directory, safe_serialization=True)

    def load_checkpoint(self, path: str) -> None:
        """This rank's shards, optimizers and RNG. Under LoRA, the adapters' parts onto the base the
        saved adapter names, read from that plain checkpoint when it is not the one loaded (a warm-up
        folded the adapters into ``warm-model/``)."""
        state = torch.load(Path(path) / "megatron" / f"rank{rank_world()[0]}.pt", weights_only=False)
        if self.lora is None:
            self.model.load_state_dict(state["model"])
        else:
            base = core_lora.base_path_of(Path(path) / "adapter")
            if base != self.lora_base:
                if not safetensors_files(base)[0].is_file():
                    raise FileNotFoundError(f"{path}: its adapters were trained on {base}, which holds no "
                                            f"safetensors weights (a relative path is taken from where roll "
                                            f"run ran)")
                self._load_hf(base)
                self.lora_base = base
            adapters = self._trained_names()
            if state["model"].keys() != adapters:
                raise ValueError(f"{path}: its adapters are not this model's: missing "
                                 f"{sorted(adapters - state['model'].keys())[:5]}, unexpected "
                                 f"{sorted(state['model'].keys() - adapters)[:5]}")
            self.model.load_state_dict(state["model"], strict=False)
        for name, optimizer_state in state["optimizers"].items():
            if name not in self.optimizers:
                self.optimizers[name] = self._new_optimizer(lr=self.role_config.lr)
            _local(self.optimizers[name]).load_state_dict(optimizer_state)
        self.generator.set_state(state["generator"])


class MegatronTrainStrategy(_MegatronTrainable, TrainStrategy):
    """The policy on Megatron-Core (``roles.actor_train.strategy: megatron``), LoRA included."""

    def weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        # One rank per stage sends; the others take part in the gathers. Under LoRA the adapters
        # alone travel and the inference side merges them (roll_core.strategies.lora.AdapterMerger).
        if self.lora is not None:
            scaling = self.lora.alpha / self.lora.rank
            tensors = megatron_lora.adapter_tensors(self.model, self.layout, self._gather, scaling)
        else:
            tensors = self.hf_parameters()
        yield from bucketed(tensors, bucket_bytes, keep=self._owner())

    def base_log_probs(self, batch: Batch, temperature: float, distribution: bool = False) -> torch.Tensor:
        """Log-probs under the base model, the adapters disabled (a LoRA run's reference)."""
        if self.lora is None:
            raise RuntimeError("base_log_probs needs roles.actor_train.lora")
        with megatron_lora.adapters_disabled(self.model):
            return self.compute_log_probs(batch, temperature, distribution)

    def fold_adapters(self, base_path: str) -> None:
        """LoRA: the adapters become part of the base (``base_path`` holds it as a plain model) and
        fresh ones start; the policy is unchanged."""
        megatron_lora.fold(self.model, self.seed, self.layout)
        self.lora_base = base_path


class MegatronCriticStrategy(_MegatronTrainable, CriticStrategy):
    """PPO's value model on Megatron-Core (``roles.critic.strategy: megatron``), laid out like the
    policy: the policy's checkpoint with a fresh one-label head (:func:`fresh_value_head`, the head
    the ``hf`` critic draws for the seed), whose ``model/`` is a Hugging Face
    ``...ForTokenClassification`` as ``hf``'s critic writes it."""

    value_model = True


def _local(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's states: a ZeroRedundancyOptimizer's shard (each rank
    saves and loads its own; the partition is the same for the same model and ranks), else itself."""
    return getattr(optimizer, "optim", optimizer)


class MegatronReferenceStrategy(_MegatronModel, InferStrategy):
    """A frozen model on Megatron-Core for the log-probs of a reference or distillation-teacher role
    (``roles.reference.strategy: megatron``), sharded like the policy so a model too large for one
    device still serves. It does not generate: ``roll validate`` refuses it for ``actor_infer``."""

    sharded = True  # the role's workers hold one model: they join one process group

    def generate(self, batch: Batch, *, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int = 0) -> Batch:
        raise NotImplementedError("the megatron inference strategy computes log-probs only (roles.reference); "
                                  "generation needs hf, vllm or sglang")

    def load(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError("the megatron inference strategy serves a frozen model and takes no weight updates")
