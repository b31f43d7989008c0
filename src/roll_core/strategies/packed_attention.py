"""Attention over packed rows, computed piece by piece instead of densely over each row.

Why: in a packed row (:mod:`roll_core.strategies.packing`) a response attends to its group's prompt
and to itself only. Dense attention with a 4-D mask computes every pair of a row's ``W`` positions
and throws most of them away: a row holding a group's prompt and 8 responses of 48 tokens computes
``W^2 = 390^2`` scores per head where the response tokens need about ``8 * 48 * (6 + 48 / 2)``,
14x fewer. On the 95M model of ``benchmarks/large_model.py`` dense attention was 9% of an update's
time (a torch profile), more than everything but the matrix products. Here each *piece* of a row
(a unit's prompt, or one response) gathers its own queries and the keys it may see (its prompt's,
then its own), and one ``scaled_dot_product_attention`` call computes all pieces at once:

    queries  [G, H, Q, D]       G pieces, each padded to the longest piece (Q positions)
    keys     [G, H, P + Q, D]   the piece's prompt (P = the longest prompt), then the piece itself
    mask     [G, 1, Q, P + Q]   its prompt's real positions; causal over its own
    output   [N, W, H, D]       gathered back to the rows (padding positions: any piece's)

Queries and outputs map one to one between positions and slots, so both directions, and their
gradients, are gathers (:class:`_Rows`); keys repeat a prompt for each of its responses, so their
gradient adds up (``index_select``'s own).

A query sees exactly the keys the dense mask lets it see, so the outputs are the dense pass's up to
float rounding (``tests/test_packing.py`` compares packed passes, outputs and gradients, with the
padded layout). Padding positions are nobody's key, and their own outputs are never read: they get
some piece's output and no gradient.

How it is wired: :func:`adopt` switches a model whose layers run ``sdpa`` to the attention
implementation registered here (``ATTENTION``), which is ``sdpa`` itself, masks included, unless a
forward pass hands its layers an :class:`AttentionPlan` (keyword ``PLAN_KEYWORD``, passed through by
``transformers``' models to their attention functions). Passes that bring no plan (padded passes,
generation) and attention features this path does not compute (soft-capping, position biases,
attention sinks) run ``sdpa`` with the dense mask that :func:`roll_core.strategies.packing.packed_forward`
still passes along, so they stay correct.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION = "roll_packed_sdpa"  # the name registered with transformers' attention interfaces
PLAN_KEYWORD = "roll_attention_plan"  # the forward keyword that carries the plan to the layers
_UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks")  # features only the dense path computes


@dataclass(frozen=True)
class AttentionPlan:
    """Where each piece's queries and keys lie among the ``N * W`` flattened positions of the rows.

    ``queries`` ``[G * Q]``: piece ``g``'s ``i``-th position at ``g * Q + i`` (its last one repeated past its end).
    ``keys`` ``[G * (P + Q)]``: its prompt's positions (``P`` slots; a prompt piece has none), then its own.
    ``mask`` ``[G, 1, Q, P + Q]`` bool: what each query sees (every query row sees at least one key);
    additive once the plan is moved :meth:`to` its device.
    ``slots`` ``[N * W]``: each position's slot among the ``G * Q`` query slots (any slot on padding).
    ``real_slots`` ``[G * Q, 1, 1]`` and ``real_positions`` ``[N * W, 1, 1]``: 1.0 where a slot holds a
    piece's own position, where a position is not padding; 0.0 elsewhere."""

    queries: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor
    slots: torch.Tensor
    real_slots: torch.Tensor
    real_positions: torch.Tensor

    def to(self, device: torch.device, dtype: torch.dtype) -> "AttentionPlan":
        """On ``device``, the factors in ``dtype`` and the mask additive (0 or ``dtype``'s lowest): sdpa
        would turn a boolean mask into that at every layer, forward and backward."""
        mask = self.mask
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, torch.finfo(dtype).min)
        return AttentionPlan(self.queries.to(device), self.keys.to(device), mask.to(device), self.slots.to(device),
                             self.real_slots.to(device, dtype), self.real_positions.to(device, dtype))

    @property
    def pieces(self) -> int:
        return self.mask.shape[0]


def attention_plan(pieces: torch.Tensor, positions: int) -> AttentionPlan:
    """The plan for ``pieces`` ``[G, 4]`` (each piece's flat start and length, and its prompt's flat
    start and length, 0 for a prompt piece) among ``positions`` flattened positions."""
    start, length, prompt_start, prompt_length = pieces.long().unbind(1)
    count, longest, prompt_width = len(pieces), int(length.max()), int(prompt_length.max())
    own = torch.arange(longest)
    queries = start[:, None] + torch.minimum(own[None, :], length[:, None] - 1)
    slot = torch.arange(prompt_width)
    last_prompt_slot = (prompt_length[:, None] - 1).clamp(min=0)
    prompt_keys = torch.where(prompt_length[:, None] > 0,
                              prompt_start[:, None] + torch.minimum(slot[None, :], last_prompt_slot),
                              start[:, None])  # a prompt piece has no prompt: any real position, masked out
    sees_prompt = (slot[None, :] < prompt_length[:, None])[:, None, :].expand(count, longest, prompt_width)
    sees_own = (own[None, None, :] <= own[None, :, None]) & (own[None, None, :] < length[:, None, None])
    real = own[None, :] < length[:, None]
    slots = torch.zeros(positions, dtype=torch.long)
    slots[queries[real]] = (torch.arange(count)[:, None] * longest + own[None, :])[real]
    real_positions = torch.zeros(positions)
    real_positions[queries[real]] = 1.0
    return AttentionPlan(queries=queries.reshape(-1), keys=torch.cat([prompt_keys, queries], 1).reshape(-1),
                         mask=torch.cat([sees_prompt, sees_own], 2)[:, None], slots=slots,
                         real_slots=real.reshape(-1, 1, 1).float(), real_positions=real_positions[:, None, None])


class _Rows(torch.autograd.Function):
    """``rows[k] = source[index[k]]``, for a one-to-one map between the rows of ``source`` and those of
    the result that the caller reads on (a position and its query slot): row ``m`` of ``source`` is
    taken by row ``back[m]`` alone, or ``back_keep[m]`` is 0 and no row read on takes it. So the
    gradient is a gather as well, ``grad[back] * back_keep``, instead of a zero-filled scatter that
    adds. Rows the caller does not read on (slots past a piece's end, padding) must get no gradient."""

    @staticmethod
    def forward(ctx, source, index, back, back_keep):
        ctx.save_for_backward(back, back_keep)
        return source.index_select(0, index)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        back, back_keep = ctx.saved_tensors
        return grad.index_select(0, back).mul_(back_keep), None, None, None


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """``transformers``' attention-function signature: ``query`` ``[N, H, W, D]``, ``key`` and
    ``value`` ``[N, H_kv, W, D]`` (rotary positions applied). Returns ``[N, W, H, D]`` and no weights.
    With an :class:`AttentionPlan` under ``PLAN_KEYWORD``, attention piece by piece; otherwise ``sdpa``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plan: AttentionPlan | None = kwargs.pop(PLAN_KEYWORD, None)
    if plan is None or any(kwargs.get(name) is not None for name in _UNSUPPORTED):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return _attend_pieces(module, query, key, value, plan, dropout, scaling), None


@torch.compiler.disable  # compiled layers (a role's compile) call it as it is: a plan's sizes are not the layer's
def _attend_pieces(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   plan: AttentionPlan, dropout: float, scaling: float | None) -> torch.Tensor:
    """:func:`packed_attention` by ``plan``: ``[N, W, H, D]``."""
    rows, heads, width, _ = query.shape
    count, longest, seen = plan.pieces, plan.mask.shape[2], plan.mask.shape[3]

    def flat(states: torch.Tensor) -> torch.Tensor:
        """``[N, h, W, d]`` as ``[N * W, h, d]`` (a view where the projection's layout allows)."""
        return states.transpose(1, 2).reshape(rows * width, states.shape[1], states.shape[3])

    def per_piece(states: torch.Tensor, n: int) -> torch.Tensor:
        """``[G * n, h, d]`` as ``[G, H, n, d]``. Grouped-query attention: key/value head ``j`` serves
        query heads ``j * r`` to ``(j + 1) * r - 1``."""
        states = states.view(count, n, states.shape[1], states.shape[2]).transpose(1, 2)
        return states.repeat_interleave(heads // states.shape[1], dim=1) if states.shape[1] != heads else states

    q = _Rows.apply(flat(query), plan.queries, plan.slots, plan.real_positions)
    # a prompt's keys serve every response of its unit: a plain gather, whose gradient adds them up
    k, v = (flat(states).index_select(0, plan.keys) for states in (key, value))
    out = F.scaled_dot_product_attention(per_piece(q, longest), per_piece(k, seen), per_piece(v, seen),
                                         attn_mask=plan.mask, dropout_p=dropout if module.training else 0.0,
                                         scale=scaling)
    out = out.transpose(1, 2).reshape(count * longest, heads, out.shape[-1])
    out = _Rows.apply(out, plan.slots, plan.queries, plan.real_slots)
    return out.view(rows, width, heads, out.shape[-1])


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, packed_attention)
        AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # sdpa's masks, unchanged


def adopt(model, config) -> bool:
    """Switch ``model`` (whose Hugging Face config is ``config``) from ``sdpa`` to :data:`ATTENTION`,
    where its forward passes keywords on to its layers. Whether its packed passes may carry a plan."""
    implementation = getattr(config, "_attn_implementation", None)
    if implementation == ATTENTION:
        return True
    if implementation != "sdpa" or not _takes_keywords(model):
        return False
    _register()
    config._attn_implementation = ATTENTION
    return True


def _takes_keywords(model) -> bool:
    """Whether ``model``'s forward takes ``**kwargs`` (models of the ``transformers`` 5 kind pass them on
    to their attention functions; a forward without them would reject the plan)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
