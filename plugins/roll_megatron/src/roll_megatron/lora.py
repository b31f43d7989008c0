"""LoRA on Megatron-Core's parallel linear layers, with the adapters peft gives a Hugging Face model.

``roles.actor_train.lora`` and ``roles.critic.lora`` under ``strategy: megatron``. Every targeted
Hugging Face projection gets an adapter of its own, as under peft, although Megatron fuses some of
them: ``linear_qkv`` carries ``q_proj``, ``k_proj`` and ``v_proj``, ``linear_fc1`` carries
``gate_proj`` and ``up_proj``. So ``target_modules`` means what it means under ``hf``; a run
computes what the ``hf`` strategy's peft model computes, at any tensor- and pipeline-parallel
layout; the adapters travel to the inference engines and save under peft's names (the core's
:mod:`roll_core.strategies.lora` does the rest).

A targeted layer computes ``W x + s B A x`` (``s = alpha / rank``; Hu et al. 2021, arXiv:2106.09685)
with ``W`` frozen. How the factors split over the tensor-parallel group follows ``W``:

* **column-parallel** (``linear_qkv``, ``linear_fc1``: ``W``'s output rows split). ``A [r, in]`` is
  whole on every rank and ``B [out / tp, r]`` holds this rank's rows. ``h = A x`` is the same on
  every rank, and since each rank's rows of ``B`` contribute to its gradient, that gradient is summed
  over the group (Megatron's ``copy_to_tensor_model_parallel_region``). The rank's output is a run
  of query groups (``linear_qkv``: each group's query heads, key, value) or the two halves of
  ``linear_fc1`` (gate, up); each projection's share is put in its place (:func:`_interleave`).
* **row-parallel** (``linear_proj``, ``linear_fc2``: ``W``'s input columns split). ``A [r, in / tp]``
  holds this rank's columns and ``B [out, r]`` is whole: ``h`` sums the ranks' ``A_t x_t``
  (``reduce_from_tensor_model_parallel_region``), then ``s B h`` is the same on every rank.

The critic's value head (its output layer, one label, whole on every rank) is not adapted: it
starts fresh, so it trains whole beside the adapters and is saved with them under its Hugging Face
names, as peft's ``modules_to_save`` keeps a ``score`` head (:func:`train_value_head`).

Fresh adapters: ``B = 0`` (the model computes what the base computes) and ``A`` drawn whole, as
``nn.Linear`` initialises a weight, from a generator seeded by the run's seed and the module's
Hugging Face name, so every layout draws the same adapters. ``lora.dropout`` is refused by ``roll
validate`` (a tensor-parallel group would need one mask on every rank).
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from roll_core.strategies.lora import A_SUFFIX, B_SUFFIX, saved_name, saved_whole_name

# Megatron layer (within a decoder layer) -> (Hugging Face module prefix, its projections, parallel kind)
FUSED = {
    "self_attention.linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj"), "column"),
    "self_attention.linear_proj": ("self_attn", ("o_proj",), "row"),
    "mlp.linear_fc1": ("mlp", ("gate_proj", "up_proj"), "column"),
    "mlp.linear_fc2": ("mlp", ("down_proj",), "row"),
}
HF_PROJECTIONS = tuple(p for _, projections, _ in FUSED.values() for p in projections)
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def base_name(name: str) -> str:
    """The Megatron name of a parameter of a wrapped layer (``linear_qkv.base_layer.weight`` ->
    ``linear_qkv.weight``), what the conversion and Megatron's own code know."""
    return name.replace(".base_layer.", ".")


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def is_split(name: str) -> bool:
    """Whether adapter parameter ``name`` holds this rank's part (``B`` of a column-parallel layer,
    ``A`` of a row-parallel one) rather than the whole factor (at tensor-parallel size above 1)."""
    kind = next(k for layer, (_, _, k) in FUSED.items() if f".{layer}.lora_" in name)
    return (".lora_B." in name) == (kind == "column")


def _interleave(parts: list[torch.Tensor], blocks: int, dim: int) -> torch.Tensor:
    """The projections' shares ``parts`` of a fused layer's output rows (along ``dim``), as the layer
    lays them out: ``blocks`` blocks, each holding every projection's share of that block in turn
    (``linear_qkv``: one block per query group, ``q k v`` in each; ``linear_fc1``: one block)."""
    dim = dim % parts[0].dim()
    split = [p.unflatten(dim, (blocks, -1)) for p in parts]
    return torch.cat(split, dim=dim + 1).flatten(dim, dim + 1)


class LoraParallelLinear(torch.nn.Module):
    """A Megatron parallel linear layer (``base_layer``, frozen by :func:`wrap`) with adapters for the Hugging Face
    projections of ``targets`` (the rest of a fused layer's projections keep their base rows).
    ``widths``: each projection's rows in one block of this rank's output, of which there are
    ``blocks`` (a row-parallel layer: one projection, all its rows, one block). Returns what the
    layer returns (``(output, bias)``)."""

    def __init__(self, base_layer: torch.nn.Module, kind: str, projections: dict[str, int], blocks: int,
                 targets: list[str], rank: int, alpha: float, tp: int):
        super().__init__()
        self.base_layer, self.kind, self.widths, self.blocks = base_layer, kind, projections, blocks
        self.scaling, self.enabled = alpha / rank, True
        in_columns = base_layer.weight.shape[1]  # this rank's
        device, dtype = base_layer.weight.device, base_layer.weight.dtype
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for name, width in projections.items():
            if name in targets:
                self.lora_A[name] = torch.nn.Parameter(torch.empty(rank, in_columns, device=device, dtype=dtype))
                self.lora_B[name] = torch.nn.Parameter(torch.zeros(width * blocks, rank, device=device, dtype=dtype))
        self.whole_in = in_columns * (tp if kind == "row" else 1)  # A's columns before a row layer's split

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # Megatron's code reads the layer's own attributes (its config, say)
            if name == "base_layer":
                raise
            return getattr(self.base_layer, name)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        out, bias = self.base_layer(x, *args, **kwargs)
        if not self.enabled or not len(self.lora_A):
            return out, bias
        from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                                   reduce_from_tensor_model_parallel_region)

        names = list(self.lora_A.keys())
        a = torch.cat([self.lora_A[n] for n in names])  # one product and one collective for all of them
        if self.kind == "row":
            h = reduce_from_tensor_model_parallel_region(F.linear(x, a), group=self.base_layer.tp_group)
            return out + F.linear(h, self.lora_B[names[0]]) * self.scaling, bias
        h = copy_to_tensor_model_parallel_region(F.linear(x, a), group=self.base_layer.tp_group)
        hs = h.split(a.shape[0] // len(names), dim=-1)
        delta = {n: F.linear(part, self.lora_B[n]) * self.scaling for part, n in zip(hs, names)}
        parts = [delta[n] if n in delta else out.new_zeros(*out.shape[:-1], w * self.blocks)
                 for n, w in self.widths.items()]
        return out + _interleave(parts, self.blocks, -1), bias

    def delta_weight(self) -> torch.Tensor:
        """``s B A`` of every adapter, laid out as this rank's ``W`` (zeros where no adapter is)."""
        if self.kind == "row":
            (name,) = self.lora_A.keys()
            return self.scaling * self.lora_B[name] @ self.lora_A[name]
        w = self.base_layer.weight
        parts = [self.scaling * self.lora_B[n] @ self.lora_A[n] if n in self.lora_A
                 else w.new_zeros(width * self.blocks, w.shape[1]) for n, width in self.widths.items()]
        return _interleave(parts, self.blocks, 0)


def wrap(model: torch.nn.Module, settings, config, tp: int, targets: list[str]) -> None:
    """Freeze the model and replace the decoder layers' parallel linears that carry a targeted
    projection (``targets``: Hugging Face suffixes) with :class:`LoraParallelLinear`."""
    head_dim, per_group = config.kv_channels, config.num_attention_heads // config.num_query_groups
    ffn, hidden = config.ffn_hidden_size // tp, config.hidden_size
    shapes = {"self_attention.linear_qkv": ({"q_proj": per_group * head_dim, "k_proj": head_dim,
                                             "v_proj": head_dim}, config.num_query_groups // tp),
              "mlp.linear_fc1": ({"gate_proj": ffn, "up_proj": ffn}, 1),
              "self_attention.linear_proj": ({"o_proj": hidden}, 1), "mlp.linear_fc2": ({"down_proj": hidden}, 1)}
    for param in model.parameters():
        param.requires_grad_(False)
    for name, module in list(model.named_modules()):
        match = _LAYER.fullmatch(name)
        if match is None or match[2] not in FUSED or not set(FUSED[match[2]][1]) & set(targets):
            continue
        widths, blocks = shapes[match[2]]
        parent_name, child = name.rsplit(".", 1)
        layer = LoraParallelLinear(module, FUSED[match[2]][2], widths, blocks, targets, settings.rank,
                                   settings.alpha, tp)
        setattr(model.get_submodule(parent_name), child, layer)


def train_value_head(model: torch.nn.Module) -> None:
    """After :func:`wrap`: a value model's head (``output_layer``, on the last stage) trains whole:
    a fresh head is no value head until trained, and no adapter can make it one."""
    head = getattr(model, "output_layer", None)
    for param in head.parameters() if head is not None else ():
        param.requires_grad_(True)


def trained_whole(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The parameters trained beside the adapters, by Megatron name (a critic's value head)."""
    for name, param in model.named_parameters():
        if param.requires_grad and not is_adapter(name):
            yield name, param


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, LoraParallelLinear]]:
    for name, module in model.named_modules():
        if isinstance(module, LoraParallelLinear):
            yield name, module


def hf_module(name: str, projection: str, layer_offset: int) -> str:
    """The Hugging Face module of ``projection`` in Megatron layer ``name`` (this stage's index)."""
    match = _LAYER.fullmatch(name)
    assert match is not None, name
    return f"model.layers.{int(match[1]) + layer_offset}.{FUSED[match[2]][0]}.{projection}"


def fresh_adapters(model: torch.nn.Module, seed: int, layout) -> None:
    """``B = 0`` and ``A`` drawn whole as ``nn.Linear`` draws a weight (Kaiming-uniform with
    ``a = sqrt(5)``), from a generator seeded by ``seed`` and the module's Hugging Face name; a
    row-parallel layer keeps this rank's columns. Every layout gets the same adapters."""
    with torch.no_grad():
        for name, layer in lora_layers(model):
            for projection, a in layer.lora_A.items():
                module = hf_module(name, projection, layout.layer_offset)
                g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(module.encode()))
                whole = torch.empty(a.shape[0], layer.whole_in)
                bound = 1 / math.sqrt(layer.whole_in)  # kaiming_uniform_(a=sqrt(5)) on fan_in columns
                whole.uniform_(-bound, bound, generator=g)
                a.copy_(_own_part(whole, layer.kind == "row", layout))
                layer.lora_B[projection].zero_()


def _own_part(whole: torch.Tensor, split: bool, layout, dim: int = 1) -> torch.Tensor:
    return whole.chunk(layout.tp, dim=dim)[layout.tp_rank] if split and layout.tp > 1 else whole


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """The base model for the duration (a LoRA run's reference)."""
    layers = [layer for _, layer in lora_layers(model)]
    for layer in layers:
        layer.enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.enabled = True


def fold(model: torch.nn.Module, seed: int, layout) -> None:
    """``W <- W + s B A`` on this rank's part of every adapted weight, then fresh adapters: the
    policy is unchanged and becomes the base (a LoRA run's warm-up)."""
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.base_layer.weight.add_(layer.delta_weight())
    fresh_adapters(model, seed, layout)


def whole_adapters(model: torch.nn.Module, layout, gather) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(Hugging Face module, A [r, in], B [out, r])`` of every adapter of this stage,
    whole (``gather(tensor, dim)``: this rank's part concatenated with the other tensor-parallel
    ranks' along ``dim``, a collective every rank joins); ``B`` unscaled, as peft keeps it."""
    for name, layer in lora_layers(model):
        for projection, a in layer.lora_A.items():
            b = layer.lora_B[projection]
            a, b = (gather(a.detach(), 1), b.detach()) if layer.kind == "row" else (a.detach(), gather(b.detach(), 0))
            yield hf_module(name, projection, layout.layer_offset), a, b


def adapter_tensors(model, layout, gather, scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """What a weight sync sends: ``m.lora_A`` and ``m.lora_B`` (scaled), whole, on CPU."""
    for module, a, b in whole_adapters(model, layout, gather):
        yield module + A_SUFFIX, a.float().cpu()
        yield module + B_SUFFIX, (b.float() * scaling).cpu()


def adapter_state(model, layout, gather) -> dict[str, torch.Tensor]:
    """The adapters under peft's saved names, whole and on CPU (what ``adapter/`` holds), and a
    critic's value head (whole on every rank) under its own."""
    state = {}
    for module, a, b in whole_adapters(model, layout, gather):
        state[saved_name(module, "A")], state[saved_name(module, "B")] = a.cpu(), b.cpu()
    for name, param in trained_whole(model):
        for hf_name, tensor in layout.to_hf(name, [param.detach().cpu()]):
            state[saved_whole_name(hf_name)] = tensor
    return state


def load_adapter_state(model: torch.nn.Module, layout, state: dict[str, torch.Tensor]) -> None:
    """Adapters under peft's saved names (:func:`adapter_state`'s, or a peft model's) into this
    rank's parts, and a critic's value head; every adapter of this stage must be there."""
    with torch.no_grad():
        for name, param in trained_whole(model):
            param.copy_(layout.to_megatron(name, lambda hf_name: state[saved_whole_name(hf_name)]))
        for name, layer in lora_layers(model):
            for projection, a in layer.lora_A.items():
                module = hf_module(name, projection, layout.layer_offset)
                b = layer.lora_B[projection]
                whole_a, whole_b = state[saved_name(module, "A")], state[saved_name(module, "B")]
                a.copy_(_own_part(whole_a, layer.kind == "row", layout))
                b.copy_(_own_part(whole_b, layer.kind == "column", layout, dim=0))
