"""``hf``: the built-in strategy on plain transformers + torch, for training, inference and reference.

It runs anywhere torch runs (CPU here, one GPU elsewhere) and is the reference the sharded backends
(``deepspeed``, ``megatron``, ``fsdp2``) and the fast inference engines (``vllm``, ``sglang``) are
checked against. Each worker owns its own ``torch.Generator``: sampling never touches the global
RNG, which is what makes the ``local`` and ``ray`` executors agree sample for sample.

Training implements the engine primitives of :class:`roll_core.strategy.Trainable` only; the
update loop is the core's (:mod:`roll_core.training`) and the losses are passed in.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any, Callable, ClassVar, Collection, Iterator

import torch

from roll_core.data import Batch
from roll_core.multimodal import batch_images, image_counts, model_images
from roll_core.runtime.distributed import barrier, bucketed, rank_world, sum_gradients
from roll_core.strategies import cpu_matmul, cuda_graph, float32_attention, lora, precision
from roll_core.strategies.compiled import compile_layers
from roll_core.strategies.models import VALUE_HEAD, default_device, full_sequence, load_causal_lm, load_value_model
from roll_core.strategies.packing import model_config, packed_forward, packed_inputs
from roll_core.strategies.sequences import (causal_lm_outputs, end_token_ids, padding_id, position_ids_from_mask,
                                            never_drawn, response_end_ids, response_outputs, sample_responses,
                                            token_ids)
from roll_core.strategies.sharded import TENSORS, WholeParameters
from roll_core.strategy import CriticStrategy, InferStrategy, TrainStrategy, request_cancelled
from roll_core.training import micro_batches


class TorchOffloading:
    """Colocation for a torch model (``self.model``) and its optimizers: on a GPU the model (and the optimizers' moments) go to host memory while another
    role uses the device. On CPU there is nothing to free."""

    device: torch.device
    model: Any

    def offload(self) -> None:
        if self.device.type != "cpu":
            self._move_states(torch.device("cpu"))

    def reload(self) -> None:
        if self.device.type != "cpu":
            self._move_states(self.device)

    def _move_states(self, device: torch.device) -> None:
        self.model.to(device)
        for optimizer in getattr(self, "optimizers", {}).values():  # inference strategies have none
            local = getattr(optimizer, "optim", optimizer)  # a ZeroRedundancyOptimizer keeps its shard's states there
            for state in local.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        state[key] = value.to(device)
        if device.type == "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()


class _Sampling(TorchOffloading, precision.Autocasting):
    """A causal LM with its own sampling RNG (inference, reference and the trained policy)."""

    def __init__(self, model_path: str, role_config, seed: int):
        self.model_path, self.role_config = model_path, role_config
        self.precision = self.autocast_precision(role_config)  # strategy_options.precision
        self.device = default_device()
        self.model = load_causal_lm(model_path, self.device)
        cpu_matmul.adopt(self.model)  # runtime.cpu_matmul
        float32_attention.adopt(self.model, self.precision, self.device)  # bf16 on the CPU
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.never = never_drawn(self.model.config)  # an image-text model's image token: no mass in the policy

    def _to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def _outputs(self, batch: Batch, wanted: Collection[str], temperature: float) -> dict[str, torch.Tensor]:
        """The causal LM's outputs for ``batch`` (on the device), unmasked: over packed rows when
        the role packs sequences (:mod:`roll_core.strategies.packing`), else over the padded layout;
        in the role's precision (:mod:`roll_core.strategies.precision`; the outputs are float32)."""
        with precision.autocast(self.device, self.precision):
            return self._model_outputs(batch, wanted, temperature)

    def _model_outputs(self, batch: Batch, wanted: Collection[str], temperature: float) -> dict[str, torch.Tensor]:
        packed = None if "position_ids" in batch else packed_inputs(self.model, batch, self.role_config)
        images = batch_images(batch, self.model.config)
        if packed is not None:
            logits = packed.at_responses(packed_forward(self.model, packed, self.device, images,
                                                        image_counts(batch)).logits)
            return response_outputs(logits, self._to(batch["responses"]), wanted, temperature, self.never)
        ids, mask = (self._to(t) for t in full_sequence(batch))
        if "position_ids" in batch:  # packed rows: no mask, so each example attends to itself (its positions restart)
            logits = self.model(input_ids=ids, position_ids=self._to(batch["position_ids"]), use_cache=False).logits
        else:
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                                use_cache=False, **model_images(images, self.device, image_counts(batch))).logits
        return causal_lm_outputs(logits, ids, batch["responses"].shape[1], wanted, temperature, self.never)

    @torch.no_grad()
    def forward(self, batch: Batch, outputs: Collection[str], temperature: float) -> dict[str, torch.Tensor]:
        self.model.eval()
        rmask = self._to(batch["response_mask"])
        out = self._outputs(batch, outputs, temperature)
        return {k: (v * (rmask[..., None] if v.dim() == 3 else rmask)).cpu() for k, v in out.items()}

    def compute_log_probs(self, batch: Batch, temperature: float, distribution: bool = False) -> torch.Tensor:
        name = "log_dist" if distribution else "log_probs"
        return self.forward(batch, (name,), temperature)[name]

    def rng_state(self):
        return self.generator.get_state()

    def set_rng_state(self, state) -> None:
        self.generator.set_state(state)


class HFInferStrategy(_Sampling, InferStrategy):
    """Generation with a KV-cached sampling loop (its steps replayed from CUDA graphs on a GPU:
    :mod:`roll_core.strategies.cuda_graph`); log-probs with one forward pass."""

    def __init__(self, model_path: str, role_config, seed: int):
        super().__init__(model_path, role_config, seed)
        self.cuda_graphs = self.graphs_wanted(role_config)  # off for good once a capture fails

    def autocast_precision(self, role_config) -> str:
        return cuda_graph.options(role_config).precision

    def graphs_wanted(self, role_config) -> bool:
        """``strategy_options.cuda_graphs``; a subclass that registers options of its own overrides
        this, as it does :meth:`autocast_precision`."""
        return cuda_graph.options(role_config).cuda_graphs

    @functools.cached_property
    def end_ids(self) -> list[int]:
        """The ids at which a response ends (:func:`~roll_core.strategies.sequences.response_end_ids`),
        with those of the loaded configs, which name them for a model loaded by its hub name too."""
        cfg, generation = model_config(self.model), getattr(self.model, "generation_config", None)
        return token_ids(response_end_ids(self.model_path), end_token_ids(cfg, generation))

    @torch.no_grad()
    def generate(self, batch: Batch, *, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int = 0) -> Batch:
        self.model.eval()
        cfg, generation = model_config(self.model), getattr(self.model, "generation_config", None)
        prompts = (self._to(batch["prompt_ids"]), self._to(batch["prompt_mask"]))
        images = batch_images(batch, self.model.config)
        sampling: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens, eos_token_id=self.end_ids, pad_token_id=padding_id(cfg, generation),
            temperature=temperature, top_p=top_p, top_k=top_k, generator=self.generator, should_stop=request_cancelled)
        if images is not None:  # CUDA graphs replay text-only steps: image prompts decode eagerly
            sampling.update(images=self._to(images), image_counts=image_counts(batch), never=self.never)
        with precision.autocast(self.device, self.precision):  # sampling itself is on float32 logits
            out = None if images is not None else self._graphed(prompts, sampling)
            if out is None:  # eager decoding; on CPU from packed weights (runtime.pack_decoding_weights)
                with cpu_matmul.packed_for_decoding(self.model):
                    out = sample_responses(self.model, *prompts, **sampling)
            responses, mask, logp = out
        return batch.update(responses=responses.cpu(), response_mask=mask.cpu(), infer_log_probs=logp.cpu())

    def _graphed(self, prompts: tuple[torch.Tensor, torch.Tensor], sampling: dict):
        """The responses sampled with CUDA graphs where they apply, else None (the caller decodes
        eagerly); a model whose step cannot be captured is warned about once and decodes eagerly after."""
        if not (self.cuda_graphs and cuda_graph.supported(self.model, self.device)):
            return None
        try:
            return cuda_graph.sample_responses(self.model, *prompts, **sampling)
        except cuda_graph.CaptureFailed as error:
            self.cuda_graphs = False
            warnings.warn(f"{error}; this engine decodes without CUDA graphs from now on", RuntimeWarning, stacklevel=3)
            return None

    @torch.no_grad()
    def load(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in bucket:
            params[name].data.copy_(tensor.to(self.device))

    def can_share(self, parameters: dict[str, torch.Tensor]) -> bool:
        own = dict(self.model.named_parameters())
        return own.keys() == parameters.keys() and all(
            (t.shape, t.dtype, t.device) == (own[name].shape, own[name].dtype, own[name].device)
            for name, t in parameters.items())

    def share(self, parameters: dict[str, torch.Tensor]) -> None:
        """Every parameter points at the trainer's tensor of its name; the model's own storage is freed."""
        own = dict(self.model.named_parameters())
        for name, tensor in parameters.items():
            own[name].data = tensor


FUSED_ADAMW_DEVICE_TYPES = ("cpu", "cuda")  # where torch has a fused AdamW kernel that roll runs


def fused_adamw(params: list[torch.Tensor]) -> bool | None:
    """Whether AdamW should step ``params`` on torch's fused kernel: True for plain floating-point
    tensors all on one device type of ``FUSED_ADAMW_DEVICE_TYPES``, else None (torch's default: a
    loop over the tensors on the CPU, ``foreach`` on a GPU). FSDP2's sharded parameters (DTensors)
    keep the default.

    Why: the default CPU loop runs a dozen elementwise ops per tensor, each a pass over memory; the
    fused kernel makes one. On the 95M model of ``benchmarks/large_model.py`` (2 cores) the loop's
    step took 0.18-0.23 s inside an RL step; side by side, 0.146 s against 0.049 s fused
    (``benchmarks/bench_fused_adamw.py``). It is the same update up to float rounding, and the
    default of ``transformers``' Trainer (so of TRL) since torch 2.8."""
    devices = {p.device.type for p in params}
    plain = all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_floating_point() for p in params)
    return True if plain and len(devices) == 1 and devices <= set(FUSED_ADAMW_DEVICE_TYPES) else None


class TorchPrimitives:
    """The engine primitives on a torch model with torch's AdamW, shared by the policy and the value
    model, and by backends that shard the model themselves (they override ``forward_backward``,
    ``reduce_gradients`` or ``clip_gradients``). Data-parallel replicas hold the whole model;
    gradients are summed over them after backward."""

    model: Any
    device: torch.device
    role_config: Any
    optimizers: dict[str, torch.optim.Optimizer]
    _outputs: Callable[[Batch, Collection[str], float], dict[str, torch.Tensor]]  # the model's outputs
    data_parallel_group: Callable[[], Any]  # the Trainable's

    def prepare_model(self) -> None:
        """Hook for subclasses that wrap or shard the model before the optimizer is built."""

    def _build_optimizers(self) -> None:
        self.optimizers = {"default": self._new_optimizer(lr=self.role_config.lr,
                                                          weight_decay=self.role_config.weight_decay)}

    def _new_optimizer(self, **settings) -> torch.optim.Optimizer:
        """torch's AdamW over the parameters that train (all, or LoRA's adapters), on its fused
        kernel where that takes them (:func:`fused_adamw`); a backend that shards optimizer states
        wraps it."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, fused=fused_adamw(params), **settings)

    def forward_backward(self, mini: Batch, loss_fn, *, micro_batch_size: int,
                         denominators: tuple[float, float]) -> list[dict[str, float]]:
        self.model.train()
        per_micro = []
        max_tokens = getattr(self.role_config, "max_tokens_per_micro_batch", None)
        for micro in micro_batches(mini, micro_batch_size, max_tokens, self.data_parallel_group()):
            micro = Batch({k: v.to(self.device) for k, v in micro.tensors.items()}, micro.non_tensors)
            loss, metrics = loss_fn(self._outputs(micro, loss_fn.outputs, loss_fn.temperature), micro, *denominators)
            self.backward(loss)
            per_micro.append(metrics)
        self.reduce_gradients()
        return per_micro

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate one micro-batch's share of the mini-batch loss (engines hook in here)."""
        loss.backward()

    def reduce_gradients(self) -> None:
        """Sum gradients over data-parallel ranks (replicated model)."""
        sum_gradients(self.model.parameters())

    def clip_gradients(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):  # sharded parameters give a DTensor norm
            norm = norm.full_tensor()
        return float(norm)

    def optimizer_step(self, optimizer: str = "default", lr: float | None = None) -> None:
        if optimizer not in self.optimizers:  # a phase of its own: fresh moments, sized for its loss
            self.optimizers[optimizer] = self._new_optimizer(lr=lr or self.role_config.lr)
        opt = self.optimizers[optimizer]
        if lr is not None:
            for group in opt.param_groups:
                group["lr"] = lr
        opt.step()

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)


class PlainExport:
    """``export_model`` for a strategy whose model is a Hugging Face model, however a backend holds
    its weights: every rank builds :meth:`_plain_model_state` (a sharded backend gathers there, with
    collectives every rank takes part in), rank 0 writes :meth:`_plain_model` with it, and every rank
    waits until the directory is complete. Backends override the two parts, never the write."""

    model: Any
    lora: Any = None  # the role's lora settings where the strategy trains adapters
    full_parameters: Callable[[], Iterator[tuple[str, torch.Tensor]]]  # the trained strategy's
    # how LoRA's functions read and write whole parameters (a backend that partitions them says how)
    whole_parameters: WholeParameters = TENSORS

    @property
    def peft_model(self) -> Any:
        """Under LoRA, the peft model: ``self.model``, or the one an engine wraps (a subclass whose
        ``self.model`` became an engine keeps the Hugging Face model as ``self.module``: DeepSpeed)."""
        return getattr(self, "module", self.model)

    def _plain_model(self) -> Any:
        """The model to write: an engine that wraps the model keeps it as ``self.module``
        (DeepSpeed); under LoRA the base model, which the merged weights fill."""
        model = getattr(self, "module", self.model)
        return model.get_base_model() if self.lora is not None else model

    def _plain_model_state(self) -> dict[str, torch.Tensor]:
        """The weights to write, on the ranks that need them: whole tensors on every replica here,
        so rank 0 alone reads them (under LoRA, the adapters merged)."""
        if rank_world()[0] != 0:
            return {}
        return dict(self.full_parameters()) if self.lora is not None else self._plain_model().state_dict()

    def export_model(self, directory: str) -> None:
        """The model as a plain Hugging Face directory (safetensors; under LoRA, the adapters merged).
        Called on every rank."""
        state = self._plain_model_state()
        if rank_world()[0] == 0:
            self._plain_model().save_pretrained(directory, state_dict=state, safe_serialization=True)
        del state
        barrier()


class WholeCheckpoints(PlainExport):
    """``save_checkpoint``/``load_checkpoint`` of a trained role whose ranks hold whole tensors:
    ``model/`` (a plain Hugging Face directory: under LoRA only with ``save: merged``, the adapters
    merged), ``adapter/`` under LoRA (peft's format), and ``train_state.pt`` (the optimizer's states
    and, for a policy, its sampling generator's). Rank 0 writes for every replica."""

    optimizers: dict[str, torch.optim.Optimizer]

    def _plain_state(self, directory: str) -> dict[str, torch.Tensor]:
        """The state dict of the plain model ``export_model`` wrote to ``directory``."""
        raise NotImplementedError

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, whole tensor on CPU)`` of every parameter (under LoRA, of the merged model: a
        critic's with its trained head); sharded subclasses gather here."""
        if self.lora is not None:
            yield from lora.merged_parameters(self.peft_model, self.whole_parameters)
            return
        for name, param in self.peft_model.named_parameters():
            yield name, self.whole_parameters.read(param).cpu()

    def _sampling_state(self) -> dict[str, Any]:
        """A policy's sampling generator, which a resumed run continues (a critic has none)."""
        generator = getattr(self, "generator", None)
        return {} if generator is None else {"generator": generator.get_state()}

    def _restore_sampling(self, state: dict[str, Any]) -> None:
        if "generator" in state:
            getattr(self, "generator").set_state(state["generator"])

    def save_checkpoint(self, path: str) -> None:
        root = Path(path)
        if self.lora is None or self.lora.save == "merged":
            self.export_model(str(root / "model"))  # on every rank
        if rank_world()[0] != 0:  # replicas are identical: rank 0 writes for all
            return
        if self.lora is not None:
            lora.save_adapter(self.model, root / "adapter")
        torch.save({"optimizer": self.optimizers["default"].state_dict(), **self._sampling_state()},
                   root / "train_state.pt")

    def load_checkpoint(self, path: str) -> None:
        root = Path(path)
        if self.lora is not None:
            lora.load_adapter(self.model, root / "adapter")
        else:
            self.model.load_state_dict(self._plain_state(str(root / "model")))
        state = torch.load(root / "train_state.pt", weights_only=False)
        self.optimizers["default"].load_state_dict(state["optimizer"])
        self._restore_sampling(state)


class HFTrainStrategy(WholeCheckpoints, TorchPrimitives, _Sampling, TrainStrategy):
    """AdamW on the full model, or on LoRA adapters (``roles.actor_train.lora``,
    :mod:`roll_core.strategies.lora`); the policy's log-probs, entropy and log-distributions as outputs."""

    # the model's parameters are whole tensors that the updates change in place, which an engine in
    # this process may compute with (shared_parameters); a backend that shards them says False
    holds_whole_parameters: ClassVar[bool] = True

    def __init__(self, model_path: str, role_config, seed: int):
        super().__init__(model_path, role_config, seed)
        self.lora = getattr(role_config, "lora", None)
        self.seed = seed  # fresh LoRA adapters are drawn from it (lora.wrap, lora.fold)
        if self.lora is not None:
            self.model = lora.wrap(self.model, self.lora, model_path, seed)
        self.prepare_model()
        if getattr(role_config, "compile", False):
            compile_layers(self.model)  # under LoRA, the layers with their adapters
        self._build_optimizers()

    def shared_parameters(self) -> dict[str, torch.Tensor] | None:
        # the live tensors where full_parameters yields them as they are: no adapters to merge, and
        # a model that holds its parameters whole
        if self.lora is not None or not self.holds_whole_parameters:
            return None
        return {name: param.detach() for name, param in self.model.named_parameters()}

    def weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        # On every rank (sharded subclasses gather here); replicas are identical: rank 0 sends for all.
        # Under LoRA the adapters alone travel; the inference side merges them (lora.AdapterMerger).
        tensors = (lora.adapter_tensors(self.peft_model, self.whole_parameters) if self.lora is not None
                   else self.full_parameters())
        yield from bucketed(tensors, bucket_bytes, keep=rank_world()[0] == 0)

    def base_log_probs(self, batch: Batch, temperature: float, distribution: bool = False) -> torch.Tensor:
        """Log-probs under the base model, the adapters disabled (a LoRA run's reference)."""
        if self.lora is None:
            raise RuntimeError("base_log_probs needs roles.actor_train.lora")
        with lora.adapters_disabled(self.peft_model):
            return self.compute_log_probs(batch, temperature, distribution)

    def fold_adapters(self, base_path: str) -> None:
        """LoRA: the adapters become part of the base (``base_path`` holds it as a plain model) and
        fresh ones start; the policy is unchanged (:func:`roll_core.strategies.lora.fold`)."""
        lora.fold(self.peft_model, base_path, self.seed, self.whole_parameters)

    def _plain_state(self, directory: str) -> dict[str, torch.Tensor]:
        # from_pretrained resolves tied weights and shards the same way it does for any checkpoint
        return load_causal_lm(directory).state_dict()


class HFCriticStrategy(WholeCheckpoints, TorchPrimitives, TorchOffloading, precision.Autocasting, CriticStrategy):
    """PPO's value model: the policy checkpoint with a fresh one-label head
    (:func:`~roll_core.strategies.models.load_value_model`), ``values`` as its output; under
    ``roles.critic.lora`` the backbone trains adapters and the head trains whole
    (:mod:`roll_core.strategies.lora`). ``model/`` stays a plain Hugging Face directory."""

    def __init__(self, model_path: str, role_config, seed: int):
        self.role_config = role_config
        self.precision = self.autocast_precision(role_config)  # strategy_options.precision
        self.device = default_device()
        self.model = load_value_model(model_path, self.device, seed)
        cpu_matmul.adopt(self.model)  # runtime.cpu_matmul
        float32_attention.adopt(self.model, self.precision, self.device)  # bf16 on the CPU
        self.lora = getattr(role_config, "lora", None)
        if self.lora is not None:  # the fresh head trains whole: no adapter could make it a value head
            self.model = lora.wrap(self.model, self.lora, model_path, seed, key="roles.critic.lora", head=VALUE_HEAD)
        self.prepare_model()
        if getattr(role_config, "compile", False):
            compile_layers(self.model)
        self._build_optimizers()

    def _outputs(self, batch: Batch, wanted: Collection[str], temperature: float) -> dict[str, torch.Tensor]:
        with precision.autocast(self.device, self.precision):
            return self._values(batch)

    def _values(self, batch: Batch) -> dict[str, torch.Tensor]:
        # V(s_t) is read where the log-prob of token t is: at the position before it.
        packed = packed_inputs(self.model, batch, self.role_config)
        images = batch_images(batch, self.model.config)
        if packed is not None:
            values = packed.at_responses(packed_forward(self.model, packed, self.device, images,
                                                        image_counts(batch)).logits[..., 0])
        else:
            ids, mask = full_sequence(batch)
            ids, mask = ids.to(self.device), mask.to(self.device)
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                             **model_images(images, self.device, image_counts(batch)))
            values = out.logits[:, -batch["responses"].shape[1] - 1 : -1, 0]
        return {"values": values.float() * batch["response_mask"].to(self.device).float()}

    @torch.no_grad()
    def forward(self, batch: Batch, outputs: Collection[str], temperature: float) -> dict[str, torch.Tensor]:
        self.model.eval()
        return {k: v.cpu() for k, v in self._outputs(batch, outputs, temperature).items()}

    def _plain_state(self, directory: str) -> dict[str, torch.Tensor]:
        return load_value_model(directory, torch.device("cpu"), seed=0).state_dict()  # its trained head
