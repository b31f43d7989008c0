"""LoRA on the trained policy (and critic): adapters on the training side, merged on the inference side.

``roles.actor_train.lora`` (:class:`roll_core.config.schema.LoraConfig`) wraps actor_train's model
with ``peft``: the base weights ``W`` freeze and each targeted linear layer computes
``W x + s B A x`` with ``s = alpha / rank`` (Hu et al. 2021, arXiv:2106.09685). What this changes:

* **Training.** Only ``A`` and ``B`` require gradients, so the optimizer holds their states alone.
* **Weight sync.** The trainer sends the adapters, not the model: for a layer ``m`` (its Hugging Face
  module name), ``m.lora_A`` = ``A [r, in]`` and ``m.lora_B`` = ``s B [out, r]``
  (:func:`adapter_tensors`). Each inference worker keeps the targeted base weights, read once from
  the checkpoint both roles start from, and loads ``m.weight = W + (s B) A`` through its engine's
  ordinary ``load`` (:class:`AdapterMerger`), so every engine takes LoRA without knowing of it.
  The bytes per sync shrink by the ratio of the model's size to the adapters'.
* **Reference.** The base model is the actor with its adapters disabled
  (:func:`adapters_disabled`): a reference role without a ``model_path`` runs on actor_train's
  workers instead of loading a second copy.
* **Checkpoints.** ``adapter/`` is peft's own format (``PeftModel.from_pretrained(base, path)`` loads
  it); with ``save: merged`` a plain ``model/`` with the adapters folded in is written too.
* **Sharded trainers.** Under ``fsdp2`` every parameter, the adapters' too, is a DTensor holding this
  rank's shard; under roll-deepspeed's ZeRO-3 a partition. The functions here read and write whole
  values through ``params`` (:class:`roll_core.strategies.sharded.WholeParameters`, the strategy's
  ``whole_parameters``): reading gathers (a collective every rank joins) and writing keeps this
  rank's part, so they serve ``hf``, ``fsdp2`` and DeepSpeed alike.
* **The critic.** ``roles.critic.lora`` wraps PPO's value model the same way, its fresh value head
  (``score``) trained whole beside the adapters (peft's ``modules_to_save``: a trained copy of the
  head, saved in ``adapter/`` under the head's own names). Nothing syncs; ``model/`` of a merged
  save and ``export_model`` hold the value model with the adapters folded in and the trained head.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from roll_core.errors import ConfigError
from roll_core.strategies.sharded import TENSORS, WholeParameters

A_SUFFIX, B_SUFFIX = ".lora_A", ".lora_B"
_PEFT_PREFIX = "base_model.model."  # where peft puts the wrapped model's own module names
OUTPUT_HEADS = ("lm_head", "score")  # a causal LM's and a value model's (models.VALUE_HEAD): never adapted
_SAVED_COPY = ".modules_to_save."  # peft's trained copy of a module trained whole (the value head)
_FROZEN_ORIGINAL = ".original_module."  # and the module itself, frozen beside its copy


def _peft():
    try:
        import peft
    except ImportError as e:
        raise ConfigError("LoRA (roles.actor_train.lora, roles.critic.lora) needs peft: "
                          "pip install 'roll-core[lora]'") from e
    return peft


def linear_module_names(model: Any) -> list[str]:
    """Suffixes of the model's linear layers (what ``target_modules`` may name), output heads excluded."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and name not in OUTPUT_HEADS})


def unknown_targets(targets: list[str], known: list[str], model_path: str) -> str | None:
    """What is wrong with ``target_modules`` naming layers the model lacks (``known``: its linear
    layers); None when every one is there."""
    missing = [t for t in targets if t not in known]
    return f"{missing} are not linear layers of {model_path}; its linear layers are {known}" if missing else None


def architecture_linear_names(model_path: str, tiny=None) -> list[str]:
    """:func:`linear_module_names` of the model at ``model_path`` (``tiny``: the embedded model of
    those settings), built on the meta device: its layers without weights, for ``roll validate``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from roll_core.embedded.model import tiny_architecture

    config = tiny_architecture(tiny) if model_path == "tiny" else AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        return linear_module_names(AutoModelForCausalLM.from_config(config))


def wrap(model: Any, settings, model_path: str, seed: int, key: str = "roles.actor_train.lora",
         head: str | None = None) -> Any:
    """``model`` as a ``peft`` model with fresh adapters (``B = 0``: at first it computes what the base
    model computes; ``A`` random, drawn from a generator seeded with ``seed`` so that a seed gives the
    same adapters in any process and executor, the global RNG untouched). ``head``: a module trained
    whole beside the adapters (a value model's fresh ``score``). Unknown ``target_modules`` are
    reported with the model's linear layers, under the config ``key``."""
    peft = _peft()
    targets = settings.target_modules
    if targets != "all-linear" and (problem := unknown_targets(targets, linear_module_names(model), model_path)):
        raise ConfigError(f"{key}.target_modules: {problem}")
    config = peft_config(settings, targets, model_path, [head] if head else None)
    with warnings.catch_warnings(), _seeded(model, seed):
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)  # peft, v5
        return peft.get_peft_model(model, config)


def peft_config(settings, targets: list[str] | str, base: str, modules_to_save: list[str] | None = None) -> Any:
    """peft's ``LoraConfig`` of a role's ``lora`` settings on ``targets`` over the model at ``base``;
    ``modules_to_save``: modules trained whole (a value head)."""
    return _peft().LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                              target_modules=targets, bias="none", base_model_name_or_path=base,
                              modules_to_save=modules_to_save)


def saved_name(module: str, half: str) -> str:
    """peft's saved name of adapter ``half`` (``"A"`` or ``"B"``) of Hugging Face module ``module``."""
    return f"{_PEFT_PREFIX}{module}.lora_{half}.weight"


def saved_whole_name(name: str) -> str:
    """peft's saved name of Hugging Face parameter ``name`` of a module trained whole beside the
    adapters (a value head's ``score.weight``)."""
    return f"{_PEFT_PREFIX}{name}"


@contextlib.contextmanager
def _seeded(model: Any, seed: int):
    """The global RNG of ``model``'s device, where peft draws a fresh adapter's ``A``, seeded with
    ``seed`` for the duration and restored afterwards."""
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def _lora_layers(model: Any) -> Iterator[tuple[str, Any]]:
    """``(Hugging Face module name, peft LoRA layer)`` of every adapted layer."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name.removeprefix(_PEFT_PREFIX), module


def _factors(layer: Any, params: WholeParameters) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [r, in], s B [out, r])`` of a layer's active adapter, detached, in float32."""
    (adapter,) = layer.active_adapters
    a = params.read(layer.lora_A[adapter].weight).float()
    b = params.read(layer.lora_B[adapter].weight).float() * layer.scaling[adapter]
    return a, b


def adapter_tensors(model: Any, params: WholeParameters = TENSORS) -> Iterator[tuple[str, torch.Tensor]]:
    """What the trainer sends each sync: ``m.lora_A`` and ``m.lora_B`` (already scaled) on CPU."""
    for name, layer in _lora_layers(model):
        a, b = _factors(layer, params)
        yield name + A_SUFFIX, a.cpu()
        yield name + B_SUFFIX, b.cpu()


def merged_parameters(model: Any, params: WholeParameters = TENSORS) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of the base model under its Hugging Face name, targeted weights merged
    (``W + s B A``), adapters left out and a module trained whole (a value head) as its trained copy:
    the model the role computes, as a plain checkpoint."""
    layers = dict(_lora_layers(model))
    (adapter,) = model.peft_config
    for name, param in model.get_base_model().named_parameters():
        if ".lora_" in name or _FROZEN_ORIGINAL in name:  # the head's frozen original: its copy trains
            continue
        if _SAVED_COPY in name:
            yield _saved_copy_name(name, adapter), params.read(param).cpu()
            continue
        if ".base_layer." in name:
            module = name.split(".base_layer.")[0]
            name = name.replace(".base_layer.", ".")
            if name.endswith(".weight"):
                a, b = _factors(layers[module], params)
                yield name, (params.read(param).float() + b @ a).cpu()
                continue
        yield name, params.read(param).cpu()


def fold(model: Any, base_path: str, seed: int, params: WholeParameters = TENSORS) -> None:
    """Fold the adapters into the base weights (``W <- W + s B A``) and start fresh ones (``B = 0``,
    ``A`` drawn as :func:`wrap` draws it, from ``seed``): the policy is unchanged and becomes the
    base, so the adapters disabled give it from now on (a LoRA run's reference after its warm-up).
    ``base_path`` holds the folded model as a plain checkpoint; the adapter's config names it, so a
    saved adapter loads onto the right base."""
    with torch.no_grad(), _seeded(model, seed):
        for _, layer in _lora_layers(model):
            a, b = _factors(layer, params)
            weight = layer.get_base_layer().weight
            params.write(weight, params.read(weight) + (b @ a).to(weight.dtype))
            (adapter,) = layer.active_adapters
            fresh_a, fresh_b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
            # peft's fresh adapter (init_lora_weights=True): A as nn.Linear's default init, B zero;
            # drawn whole, so a sharded trainer's parts are one draw's (as on one process)
            drawn = torch.empty(params.shape(fresh_a), dtype=fresh_a.dtype, device=fresh_a.device)
            torch.nn.init.kaiming_uniform_(drawn, a=math.sqrt(5))
            params.write(fresh_a, drawn)
            params.write(fresh_b, torch.zeros(params.shape(fresh_b), dtype=fresh_b.dtype, device=fresh_b.device))
    for config in model.peft_config.values():
        config.base_model_name_or_path = base_path


def load_base(model: Any, base_path: str, params: WholeParameters = TENSORS) -> None:
    """The base weights of the plain checkpoint ``base_path`` under the adapters (a resumed run whose
    adapter was trained on a folded base)."""
    from roll_core.strategies.models import load_causal_lm

    plain = dict(load_causal_lm(base_path).named_parameters())
    for name, param in model.get_base_model().named_parameters():
        if ".lora_" not in name:
            params.write(param, plain[name.replace(".base_layer.", ".")])


def base_path(model: Any) -> str:
    """The checkpoint the adapters sit on, as the adapter's config names it."""
    (config,) = model.peft_config.values()
    return config.base_model_name_or_path


def base_path_of(directory: Path) -> str:
    """The checkpoint a saved adapter (``save_adapter``'s directory) was trained on."""
    return json.loads((directory / "adapter_config.json").read_text())["base_model_name_or_path"]


@contextlib.contextmanager
def adapters_disabled(model: Any):
    """The base model for the duration (peft's ``disable_adapter``)."""
    with model.disable_adapter():
        yield


def _saved_copy_name(name: str, adapter: str) -> str:
    """The module's own name for peft's trained copy of it: ``score.modules_to_save.default.weight``
    is ``score.weight`` (what a plain model holds, and what peft saves)."""
    return name.replace(f"{_SAVED_COPY}{adapter}.", ".")


def _adapter_parameters(model: Any) -> dict[str, torch.Tensor]:
    """The adapters' parameters, and those of a module trained whole (a value head), under the names
    peft saves them with (the adapter's name left out: ``...q_proj.lora_A.default.weight`` is saved as
    ``...q_proj.lora_A.weight``, ``score.modules_to_save.default.weight`` as ``score.weight``)."""
    (adapter,) = model.peft_config
    saved = {}
    for name, param in model.named_parameters():
        if ".lora_" in name:
            saved[name.replace(f".{adapter}.", ".")] = param
        elif _SAVED_COPY in name:
            saved[_saved_copy_name(name, adapter)] = param
    return saved


def adapter_state(model: Any, params: WholeParameters = TENSORS) -> dict[str, torch.Tensor]:
    """The adapters' whole weights on CPU, under peft's saved names (every rank of a sharded trainer
    calls it: it gathers)."""
    return {name: params.read(param).cpu() for name, param in _adapter_parameters(model).items()}


def save_adapter(model: Any, directory: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """peft's format: ``adapter_config.json`` and ``adapter_model.safetensors``. ``state``: the
    weights as :func:`adapter_state` gathered them (a sharded trainer's rank 0 writes them)."""
    (config,) = model.peft_config.values()
    write_adapter(directory, config, adapter_state(model) if state is None else state)


def write_adapter(directory: Path, config: Any, state: dict[str, torch.Tensor]) -> None:
    """An adapter directory in peft's format from its ``peft.LoraConfig`` and whole weights under
    peft's saved names (``base_model.model.<module>.lora_A.weight``; ``lora_B`` unscaled): what a
    backend that holds adapters without peft (roll-megatron) writes too."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    trainable, config.inference_mode = config.inference_mode, True  # as peft saves it: loads for inference
    try:
        config.save_pretrained(str(directory))
    finally:
        config.inference_mode = trainable
    save_file(state, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})


def load_adapter(model: Any, directory: Path, params: WholeParameters = TENSORS) -> None:
    """The adapter weights of ``save_adapter``'s directory into ``model`` (same configuration), and
    the base they were trained on when that is not the model's (a folded warm-up's). Every rank of a
    sharded trainer calls it."""
    from safetensors.torch import load_file

    saved_base = base_path_of(directory)
    if saved_base != base_path(model):
        load_base(model, saved_base, params)
        for config in model.peft_config.values():
            config.base_model_name_or_path = saved_base

    saved, adapters = load_file(directory / "adapter_model.safetensors"), _adapter_parameters(model)
    unexpected = sorted(saved.keys() - adapters.keys())
    if unexpected:
        raise ValueError(f"{directory}: adapter weights this model does not have: {unexpected[:5]}")
    for name, value in saved.items():
        params.write(adapters[name], value)


def is_adapter(name: str) -> bool:
    return name.endswith(A_SUFFIX) or name.endswith(B_SUFFIX)


class AdapterMerger:
    """The inference side: turns the adapter tensors of a sync into merged weights.

    ``merge(bucket)`` returns the bucket's plain tensors as they are and, for each layer whose ``A``
    and ``B`` have both arrived (they may come in different buckets), ``m.weight = W + (s B) A``,
    with ``W`` read from ``model_path`` the first time it is needed and kept (the targeted weights
    only). A plain tensor for a targeted weight (a full sync) replaces the kept ``W``."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self.base: dict[str, torch.Tensor] = {}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # module -> {"A": ..., "B": ...}
        self._files: dict[str, Path] | None = None
        self._loaded: dict[str, torch.Tensor] | None = None  # the model's weights by module name, in a first sync

    def merge(self, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, tensor in bucket:
            if not is_adapter(name):
                if name in self.base:  # a copy: the bucket may be a view of a buffer that is written again
                    self.base[name] = tensor.detach().to("cpu", torch.float32, copy=True)
                out.append((name, tensor))
                continue
            module, half = (name[: -len(A_SUFFIX)], "A") if name.endswith(A_SUFFIX) else (name[: -len(B_SUFFIX)], "B")
            halves = self.pending.setdefault(module, {})
            halves[half] = tensor.float().cpu()
            if len(halves) == 2:
                del self.pending[module]
                weight = module + ".weight"
                out.append((weight, self._base(weight) + halves["B"] @ halves["A"]))
        return out

    def finish(self) -> None:
        """End of a sync: every adapter came with its other half. The loaded model's weights
        (:meth:`_renamed`) go: those the adapters target are kept in ``base`` now."""
        if self._loaded:
            self._loaded = {}
        if self.pending:
            modules = sorted(self.pending)
            self.pending.clear()
            raise RuntimeError(f"a weight sync ended with half-sent adapters for {modules[:5]}")

    def _base(self, weight: str) -> torch.Tensor:
        if weight not in self.base:
            from safetensors import safe_open

            path = self._checkpoint_files().get(weight)
            if path is None:
                self.base[weight] = self._renamed(weight)
            else:
                with safe_open(str(path), framework="pt") as f:
                    self.base[weight] = f.get_tensor(weight).float()
        return self.base[weight]

    def _renamed(self, weight: str) -> torch.Tensor:
        """A weight whose checkpoint key is not its module's name (transformers saves some image-text
        models, LLaVA's among them, under older names and renames them on loading): read through
        the model loaded once, whose other weights are dropped when the sync ends (:meth:`finish`)."""
        if self._loaded is None:
            from roll_core.strategies.models import load_causal_lm

            try:
                model = load_causal_lm(self.model_path)
            except (OSError, ValueError):  # not a model transformers loads: the checkpoint's names are all there is
                self._loaded = {}
            else:
                self._loaded = {name: value.detach() for name, value in model.state_dict().items()}
        if weight not in self._loaded:
            raise KeyError(f"{self.model_path} has no weight {weight!r} to merge an adapter onto")
        return self._loaded.pop(weight).float()

    def _checkpoint_files(self) -> dict[str, Path]:
        """Which safetensors file holds each weight (read from the files' headers once)."""
        if self._files is None:
            from safetensors import safe_open

            from roll_core.strategies.models import safetensors_files

            self._files = {}
            for path in safetensors_files(self.model_path):
                with safe_open(str(path), framework="pt") as f:
                    self._files.update(dict.fromkeys(f.keys(), path))
        return self._files
