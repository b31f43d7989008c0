"""A Megatron-Core ``GPTModel`` for a Hugging Face Llama/Qwen2 checkpoint, on CPU or GPU.

The layer spec is Megatron-Core's local one (its own parallel linears and RMSNorm, no Transformer
Engine), with one change: the core attention is :class:`SDPAttention`, built on
``torch.nn.functional.scaled_dot_product_attention``, because the local ``DotProductAttention``
allocates its buffers on CUDA. It runs on both devices; on a GPU, SDPA picks its fused kernels.

Attention masks follow Megatron's convention (``True`` = masked out) and combine the causal mask
with the sequences' padding (:func:`attention_mask`). Rotary positions count from each row's first
column, not its first real token as Hugging Face's ``position_ids`` do; RoPE only sees the distance
between a query and a key, and real tokens never attend to padding, so the outputs are the same.
Packed rows (:mod:`roll_core.strategies.packing`) are the exception: a response that follows
another one in its row must be rotated by its own positions, which :func:`positions_in` hands to
the rotary embedding for one forward pass.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F


def _sdpa_attention_class() -> type:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPAttention(DotProductAttention):
        """Megatron's core attention on ``scaled_dot_product_attention`` (any device).
        query ``[sq, b, heads, d]``, key/value ``[sk, b, groups, d]`` -> ``[sq, b, heads * d]``."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            assert packed_seq_params is None and attention_bias is None, "not supported by SDPAttention"
            repeat = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            if repeat > 1:  # grouped-query attention: each key/value head serves `repeat` query heads
                key, value = key.repeat_interleave(repeat, dim=2), value.repeat_interleave(repeat, dim=2)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
            allowed = None if attention_mask is None else ~attention_mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=allowed is None,
                                                 scale=self.softmax_scale)
            sq, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    return SDPAttention


def layer_spec() -> Any:
    """Megatron-Core's local GPT layer spec (RMSNorm) with :class:`SDPAttention` as core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = _sdpa_attention_class()
    return spec


SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


def transformer_config(hf_config, params_dtype: torch.dtype, tp: int, pp: int) -> Any:
    """Megatron's ``TransformerConfig`` for a Hugging Face Llama or Qwen2 config."""
    from megatron.core.transformer import TransformerConfig

    if hf_config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"roll-megatron builds {', '.join(SUPPORTED_ARCHITECTURES)} models; this checkpoint is "
                         f"'{hf_config.model_type}'")
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", groups),
                        ("vocab_size", hf_config.vocab_size)):
        if value % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide the model's {name} ({value})")
    if hf_config.num_hidden_layers % pp:
        raise ValueError(f"pipeline_parallel_size {pp} must divide the model's num_hidden_layers "
                         f"({hf_config.num_hidden_layers})")
    qkv_bias = hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=True,
        perform_initialization=False,  # every weight comes from the checkpoint
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )


def rope_base(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


class ValueHead(torch.nn.Module):
    """A value model's output layer: ``V`` ``[S, B, 1]`` from the final hidden states ``[S, B, H]``,
    one linear unit with a bias, whole on every tensor-parallel rank. The hidden states it reads are
    the same on every rank, so each rank computes the same values, and the gradient each sends back
    is already the whole one (no collective, unlike a vocabulary-parallel output layer)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(1, dtype=dtype))

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None) -> tuple[torch.Tensor, None]:
        return F.linear(hidden, self.weight, self.bias), None  # GPTModel's call and (output, bias) return


def build_gpt_model(hf_config, config, pre_process: bool, post_process: bool, device: torch.device,
                    value_head: bool = False) -> Any:
    """This pipeline stage's ``GPTModel`` (embedding on the first stage, output layer on the last)
    on ``device``; with ``value_head``, a value model whose last stage outputs ``[B, S, 1]``
    (:class:`ValueHead`) instead of logits.

    Tied embeddings split over pipeline stages are two parameters kept equal (the caller loads both
    from the checkpoint and sums their gradients over Megatron's embedding group). On CUDA Megatron
    declares them shared itself; on CPU it cannot, as its start-up copy moves them to CUDA."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec(), vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        parallel_output=True,  # vocabulary-parallel logits: gather_vocabulary() (Megatron's gather is CUDA-only)
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings) and not value_head and (
            config.pipeline_model_parallel_size == 1 or device.type == "cuda"),
        position_embedding_type="rope", rotary_base=int(rope_base(hf_config)))
    if value_head and post_process:
        model.output_layer = ValueHead(config.hidden_size, config.params_dtype)
    _rotary_by_position(model.rotary_pos_emb, device)
    return model.to(device)


def _rotary_by_position(rope, device: torch.device) -> None:
    """Megatron's rotary embedding (``get_emb``: ``[S, 1, 1, D]``, one position per column) made to
    rotate each token by its own position while :func:`positions_in` sets them (``[S, B, 1, D]``).
    On CPU the embedding is also computed where the frequencies are: Megatron's ``get_emb`` moves
    them to CUDA on first use."""
    assert not rope.rotary_interleaved  # Llama and Qwen2 rotate halves
    by_column = rope.get_emb
    rope.positions = None

    def get_emb(max_seq_len: int, offset: int = 0) -> torch.Tensor:
        positions = rope.positions  # a token's position is at most its column: max_seq_len covers them
        if device.type == "cpu":
            freqs = rope.get_freqs_non_repeated(max_seq_len, offset)
            table = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        else:
            table = by_column(max_seq_len, offset)
        if positions is None:
            return table
        return table[:, 0, 0][positions.t().to(table.device)][:, :, None, :]  # [S, B, 1, D]

    def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        if rope.positions is None:  # Megatron's own, whose results it caches by length
            return type(rope).forward(rope, max_seq_len, offset, packed_seq, cp_group)
        return get_emb(max_seq_len, offset)  # per token: never from (or into) that cache

    rope.get_emb, rope.forward = get_emb, forward


@contextlib.contextmanager
def positions_in(model, positions: torch.Tensor | None) -> Iterator[None]:
    """Within the block, ``model``'s rotary embedding rotates token ``(b, s)`` by ``positions[b, s]``
    (None: by its column, Megatron's own)."""
    model.rotary_pos_emb.positions = positions
    try:
        yield
    finally:
        model.rotary_pos_emb.positions = None


def attention_mask(mask: torch.Tensor) -> torch.Tensor:
    """Megatron's boolean mask ``[B, 1, S, S]`` (``True`` = masked out) for padded rows ``mask``
    ``[B, S]``: causal, and no key that is padding. A query that would see no key at all (a padding
    position before a row's first token) may see itself, so its output stays finite."""
    s = mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
    allowed = causal[None] & mask.bool()[:, None, :]
    allowed |= torch.eye(s, dtype=torch.bool, device=mask.device)[None] & ~allowed.any(-1, keepdim=True)
    return ~allowed[:, None]


class _GatherVocabulary(torch.autograd.Function):
    """All-gather along the last dimension over the tensor-parallel group; the gradient of each
    rank's shard is its slice of the (identical on every rank) gradient of the whole."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.rank, ctx.width = dist.get_rank(group), shard.shape[-1]
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None


def gather_vocabulary(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits ``[B, S, V]`` from this tensor-parallel rank's ``[B, S, V / tp]``."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return logits
    return _GatherVocabulary.apply(logits, parallel_state.get_tensor_model_parallel_group())
