"""Hugging Face (Llama, Qwen2) <-> Megatron-Core weights, shard by shard.

Why written here: the maintained converters do not run on this project's CPU machines. mbridge
0.15.1 (verl's) moves the model and its pipeline broadcasts to ``torch.cuda.current_device()``, and
megatron-bridge needs Python >= 3.12 from the releases that support megatron-core 0.16. The mapping
for the two supported families is short and is tested as a round trip.

Megatron-Core names (local layer spec), per pipeline stage and tensor-parallel rank:

==========================================  ===================================  =================
Megatron                                    Hugging Face                         split over TP
==========================================  ===================================  =================
embedding.word_embeddings.weight            model.embed_tokens.weight            rows (vocabulary)
decoder.layers.L.input_layernorm.weight     model.layers.L.input_layernorm.weight          -
decoder.layers.L.self_attention.linear_qkv  q_proj, k_proj, v_proj (.weight/.bias)  query groups
decoder.layers.L.self_attention.linear_proj o_proj.weight                        columns
decoder.layers.L.pre_mlp_layernorm.weight   post_attention_layernorm.weight                -
decoder.layers.L.mlp.linear_fc1.weight      gate_proj, up_proj                   rows of each
decoder.layers.L.mlp.linear_fc2.weight      down_proj.weight                     columns
decoder.final_layernorm.weight              model.norm.weight                              -
output_layer.weight                         lm_head.weight (absent when tied)    rows (vocabulary)
output_layer.weight, .bias of a value head  score.weight, score.bias                       -
==========================================  ===================================  =================

``linear_qkv`` holds, for each query group in turn, the group's query heads, then its key head, then
its value head; a tensor-parallel rank holds a contiguous run of groups. ``L`` is the layer's index
within its pipeline stage; the Hugging Face index adds the stage's first layer.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_PER_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_VALUE_HEAD = {"output_layer.weight": "score.weight", "output_layer.bias": "score.bias"}  # one label: not split
_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")  # split along dim 0
_COLUMNS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")  # split along dim 1


class Layout:
    """What one rank holds: its tensor-parallel rank among ``tp`` and its stage's first layer.
    ``value_head``: the output layer is a value model's one-label head, named as transformers'
    ``...ForTokenClassification`` names it and the same on every rank."""

    def __init__(self, config, tp_rank: int, tp: int, layer_offset: int, value_head: bool = False):
        self.tp_rank, self.tp, self.layer_offset = tp_rank, tp, layer_offset
        self.globals = {**_GLOBAL, **_VALUE_HEAD} if value_head else _GLOBAL
        self.rows = _ROWS[:1] if value_head else _ROWS
        self.groups = config.num_query_groups
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.head_dim = config.kv_channels

    def is_split(self, name: str) -> bool:
        """Whether Megatron parameter ``name`` is split over tensor-parallel ranks (norms are not)."""
        match = _LAYER.fullmatch(name)
        rest = name if match is None else match[2]
        return self.tp > 1 and (rest in self.rows or rest in _COLUMNS or rest == "mlp.linear_fc1.weight"
                                or rest.startswith("self_attention.linear_qkv."))

    # -- Hugging Face -> Megatron ---------------------------------------------------------------
    def to_megatron(self, name: str, hf: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """This rank's shard of Megatron parameter ``name``, read from the Hugging Face tensors by
        ``hf(hf_name)``."""
        match = _LAYER.fullmatch(name)
        if match is None:
            full = hf(self.globals[name])
            return self._shard(full, 0) if name in self.rows else full
        prefix, rest = f"model.layers.{int(match[1]) + self.layer_offset}.", match[2]
        if rest in _PER_LAYER:
            full = hf(prefix + _PER_LAYER[rest])
            return self._shard(full, 1) if rest in _COLUMNS else full
        if rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]  # weight or bias
            q, k, v = (hf(f"{prefix}self_attn.{p}_proj.{kind}") for p in "qkv")
            trailing = q.shape[1:]
            per_group = torch.cat([q.reshape(self.groups, self.heads_per_group * self.head_dim, *trailing),
                                   k.reshape(self.groups, self.head_dim, *trailing),
                                   v.reshape(self.groups, self.head_dim, *trailing)], dim=1)
            return self._shard(per_group, 0).reshape(-1, *trailing)
        if rest == "mlp.linear_fc1.weight":
            gate, up = hf(prefix + "mlp.gate_proj.weight"), hf(prefix + "mlp.up_proj.weight")
            return torch.cat([self._shard(gate, 0), self._shard(up, 0)])
        raise KeyError(f"no Hugging Face weight for Megatron parameter '{name}'")

    def _shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        return full.chunk(self.tp, dim=dim)[self.tp_rank].clone()

    # -- Megatron -> Hugging Face ---------------------------------------------------------------
    def to_hf(self, name: str, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Hugging Face ``(name, tensor)`` pairs of Megatron parameter ``name`` from its shards on
        every tensor-parallel rank, in rank order (one tensor, replicated, for an unsplit one)."""
        match = _LAYER.fullmatch(name)
        if match is None:
            full = torch.cat(shards, 0) if name in self.rows else shards[0]
            return [(self.globals[name], full)]
        prefix, rest = f"model.layers.{int(match[1]) + self.layer_offset}.", match[2]
        if rest in _PER_LAYER:
            full = torch.cat(shards, 1) if rest in _COLUMNS else shards[0]
            return [(prefix + _PER_LAYER[rest], full)]
        if rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            full = torch.cat(shards, 0)
            trailing = full.shape[1:]
            per_group = full.reshape(self.groups, (self.heads_per_group + 2) * self.head_dim, *trailing)
            q, k, v = per_group.split([self.heads_per_group * self.head_dim, self.head_dim, self.head_dim], dim=1)
            return [(f"{prefix}self_attn.{p}_proj.{kind}", t.reshape(-1, *trailing).contiguous())
                    for p, t in zip("qkv", (q, k, v))]
        if rest == "mlp.linear_fc1.weight":
            halves = [s.chunk(2, dim=0) for s in shards]
            return [(prefix + "mlp.gate_proj.weight", torch.cat([g for g, _ in halves])),
                    (prefix + "mlp.up_proj.weight", torch.cat([u for _, u in halves]))]
        raise KeyError(f"no Hugging Face name for Megatron parameter '{name}'")
