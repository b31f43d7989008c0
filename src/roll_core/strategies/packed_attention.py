"""Attention over packed rows, computed piece by piece instead of densely over each row.

Why: in a packed row (:mod:`roll_core.strategies.packing`) a response attends to its group's prompt
and to itself only. Dense attention with a 4-D mask computes every pair of a row's ``W`` positions
and throws most of them away: a row holding a group's prompt and 8 responses of 48 tokens computes
``W^2 = 390^2`` scores per head where the response tokens need about ``8 * 48 * (6 + 48 / 2)``,
14x fewer. On the 95M model of ``benchmarks/large_model.py`` dense attention was 9% of an update's
time (a torch profile), more than everything but the matrix products. Here each *piece* of a row
(a unit's prompt, or one response) gathers its own queries and the keys it may see (its prompt's,
then its own), and one ``scaled_dot_product_attention`` call per group of pieces (the prompts, the
responses, each in groups of similar length) computes them all:

    queries  [G, H, Q, D]       the group's G pieces, each padded to its longest (Q positions)
    keys     [G, H, P + Q, D]   the piece's prompt (P = the longest; none for the prompts), then itself
    mask     [G, 1, Q, P + Q]   its prompt's real positions; causal over its own
    output   [N, W, H, D]       gathered back to the rows (padding positions: any piece's)

Queries and outputs map one to one between positions and slots, so both directions, and their
gradients, are gathers (:class:`_Rows`); keys repeat a prompt for each of its responses, so their
gradient adds up (``index_select``'s own).

A query sees exactly the keys the dense mask lets it see, so the outputs are the dense pass's up to
float rounding (``tests/test_packing.py`` compares packed passes, outputs and gradients, with the
padded layout). Padding positions are nobody's key, and their own outputs are never read: they get
some piece's output and no gradient.

Where rows are narrow, gathering the pieces costs more than the scores it saves, so only rows that
:func:`pays_off` go by pieces (from 256 positions wide; the quickstart's rows are about 45), and only
on the CPU: on a GPU, dense sdpa was as fast or faster at every shape measured.

How it is wired: :func:`adopt` switches a model whose layers run ``sdpa`` to the attention
implementation registered here (``ATTENTION``), which is ``sdpa`` itself, masks included, unless a
forward pass hands its layers an :class:`AttentionPlan` (keyword ``PLAN_KEYWORD``, passed through by
``transformers``' models to their attention functions). Other passes that bring no plan (padded
passes, generation) and attention features this path does not compute (soft-capping, position biases,
attention sinks) run ``sdpa`` with the dense mask that :func:`roll_core.strategies.packing.packed_forward`
still passes along, so they stay correct. On the CPU under autocast, decoding steps and passes that
record gradients attend in float32 either way (:mod:`roll_core.strategies.float32_attention`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from roll_core.strategies import float32_attention
from roll_core.strategies.compiled import OutsideCompiledCode

# Where pieces pay: gathering them costs about as much per token whatever the row, and dense attention
# costs in proportion to the row's width. On 2 CPU cores (bench_packed_attention.py and probes at
# other widths, 0.5M to 95M parameters) the update was 0.78-0.99x at rows of 45-155 positions and
# 1.04-1.34x from 276 on.
MIN_WIDTH = 256  # rows narrower than this attend densely
MIN_SAVING = 2.0  # and so do rows where dense attention computes less than twice the pieces' scores
# On a GPU dense sdpa's fused kernel skips nothing yet costs less than the gathers and the several
# smaller launches: on an H200 (fp32, the same benchmark) the update was 0.75-1.01x by pieces
DEVICE_TYPES = ("cpu",)  # devices where rows may go by pieces; elsewhere they attend densely
ATTENTION = "roll_packed_sdpa"  # the name registered with transformers' attention interfaces
PLAN_KEYWORD = "roll_attention_plan"  # the forward keyword that carries the plan to the layers
_UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks")  # features only the dense path computes


@dataclass(eq=False)  # not frozen: torch.compile guards a frozen dataclass's fields (a recompile per group count)
class AttentionPlan:
    """Where each piece's queries and keys lie among the ``N * W`` flattened positions of the rows.

    The pieces come in groups, each computed by one ``sdpa`` call at its own sizes: the prompts
    (keys: their own positions), then the responses (keys: their prompt's, then their own), each
    kind in groups of similar length (:func:`_groups`), so a long prompt or response does not widen
    every other piece's queries. Group ``k`` has ``G_k`` pieces padded to ``Q_k`` queries and
    ``K_k`` keys (``groups``), and its rows follow the earlier groups' in:

    ``queries`` ``[sum G_k * Q_k]``: piece ``g``'s ``i``-th position (its last one repeated past its end).
    ``keys`` ``[sum G_k * K_k]``: its prompt's positions (``K_k - Q_k`` slots), then its own.
    ``masks``: per group ``[G_k, 1, Q_k, K_k]``, bool: what each query sees (every query row sees at
    least one key); additive once the plan is moved :meth:`to` its device.
    ``slots`` ``[N * W]``: each position's query slot (any slot on padding).
    ``real_slots`` ``[sum G_k * Q_k, 1, 1]`` and ``real_positions`` ``[N * W, 1, 1]``: 1.0 where a
    slot holds a piece's own position, where a position is not padding; 0.0 elsewhere."""

    queries: torch.Tensor
    keys: torch.Tensor
    masks: tuple[torch.Tensor, ...]
    slots: torch.Tensor
    real_slots: torch.Tensor
    real_positions: torch.Tensor

    def to(self, device: torch.device, dtype: torch.dtype) -> "AttentionPlan":
        """On ``device``, the factors in ``dtype`` and the masks additive (0 or ``dtype``'s lowest): sdpa
        would turn a boolean mask into that at every layer, forward and backward."""
        masks = tuple(torch.zeros(m.shape, dtype=dtype).masked_fill_(~m, torch.finfo(dtype).min)
                      if m.dtype == torch.bool else m for m in self.masks)
        return AttentionPlan(self.queries.to(device), self.keys.to(device), tuple(m.to(device) for m in masks),
                             self.slots.to(device), self.real_slots.to(device, dtype),
                             self.real_positions.to(device, dtype))

    @property
    def groups(self) -> list[tuple[int, int, int]]:
        """``(G_k, Q_k, K_k)`` of each group."""
        return [(m.shape[0], m.shape[2], m.shape[3]) for m in self.masks]


def _groups(pieces: torch.Tensor) -> list[torch.Tensor]:
    """``pieces`` split into the prompts and the responses, each longest first and cut where a piece
    is no longer than half the longest of its group: a group pads its pieces to its longest, and RL
    responses are long-tailed (a few hundred tokens next to a few thousand)."""
    groups = []
    prompt = pieces[:, 3] == 0
    for kind in (pieces[prompt], pieces[~prompt]):
        kind = kind[torch.argsort(kind[:, 1], descending=True, stable=True)]
        lengths = kind[:, 1].tolist()
        first = 0
        for i in range(1, len(lengths) + 1):
            if i == len(lengths) or 2 * lengths[i] <= lengths[first]:
                groups.append(kind[first:i])
                first = i
    return groups


def pays_off(pieces: torch.Tensor, rows: int, width: int, device: torch.device | str) -> bool:
    """Whether ``rows`` x ``width`` packed rows holding ``pieces`` (as :func:`attention_plan` takes
    them), computed on ``device``, should attend piece by piece: on a device of ``DEVICE_TYPES``, rows
    at least ``MIN_WIDTH`` wide, where dense attention's ``rows * width^2`` scores are at least
    ``MIN_SAVING`` times the pieces' ``sum G_k * Q_k * K_k``."""
    if torch.device(device).type not in DEVICE_TYPES or width < MIN_WIDTH or not len(pieces):
        return False
    scores = 0
    for group in _groups(pieces):
        longest = int(group[:, 1].max())
        scores += len(group) * longest * (int(group[:, 3].max()) + longest)
    return rows * width * width >= MIN_SAVING * scores


def attention_plan(pieces: torch.Tensor, positions: int) -> AttentionPlan:
    """The plan for ``pieces`` ``[G, 4]`` (each piece's flat start and length, and its prompt's flat
    start and length, 0 for a prompt piece) among ``positions`` flattened positions."""
    queries, keys, masks, reals = [], [], [], []
    slots = torch.zeros(positions, dtype=torch.long)
    real_positions = torch.zeros(positions)
    taken = 0  # query slots of the groups before
    for group in _groups(pieces.long()):
        start, length, prompt_start, prompt_length = group.unbind(1)
        count, longest, prompt_width = len(group), int(length.max()), int(prompt_length.max())
        own = torch.arange(longest)
        at = start[:, None] + torch.minimum(own[None, :], length[:, None] - 1)
        slot = torch.arange(prompt_width)
        prompt_keys = prompt_start[:, None] + torch.minimum(slot[None, :], prompt_length[:, None] - 1)
        sees_prompt = (slot[None, :] < prompt_length[:, None])[:, None, :].expand(count, longest, prompt_width)
        sees_own = (own[None, None, :] <= own[None, :, None]) & (own[None, None, :] < length[:, None, None])
        real = own[None, :] < length[:, None]
        slots[at[real]] = (taken + torch.arange(count)[:, None] * longest + own[None, :])[real]
        real_positions[at[real]] = 1.0
        taken += count * longest
        queries.append(at.reshape(-1))
        keys.append(torch.cat([prompt_keys, at], 1).reshape(-1))
        masks.append(torch.cat([sees_prompt, sees_own], 2)[:, None])
        reals.append(real.reshape(-1))
    return AttentionPlan(queries=torch.cat(queries), keys=torch.cat(keys), masks=tuple(masks), slots=slots,
                         real_slots=torch.cat(reals).float()[:, None, None],
                         real_positions=real_positions[:, None, None])


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
    With an :class:`AttentionPlan` under ``PLAN_KEYWORD``, attention piece by piece; otherwise
    ``sdpa``. Either in float32 where :mod:`roll_core.strategies.float32_attention` applies (on the
    CPU under autocast: decoding steps and passes that record gradients)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plan: AttentionPlan | None = kwargs.pop(PLAN_KEYWORD, None)
    if plan is None or any(kwargs.get(name) is not None for name in _UNSUPPORTED):
        def attention(module, query, key, value):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
    else:
        def attention(module, query, key, value):
            return _attend_pieces(module, query, key, value, plan, dropout, scaling), None
    if float32_attention.applies(query):
        return float32_attention.attend(attention, module, query, key, value)
    return attention(module, query, key, value)


@OutsideCompiledCode  # compiled layers (a role's compile) call it as it is: a plan's sizes are not the layer's
def _attend_pieces(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   plan: AttentionPlan, dropout: float, scaling: float | None) -> torch.Tensor:
    """:func:`packed_attention` by ``plan``: ``[N, W, H, D]``."""
    rows, heads, width, _ = query.shape

    def flat(states: torch.Tensor) -> torch.Tensor:
        """``[N, h, W, d]`` as ``[N * W, h, d]`` (a view where the projection's layout allows)."""
        return states.transpose(1, 2).reshape(rows * width, states.shape[1], states.shape[3])

    def per_piece(states: torch.Tensor, count: int, n: int) -> torch.Tensor:
        """``[count * n, h, d]`` as ``[count, H, n, d]``. Grouped-query attention: key/value head ``j``
        serves query heads ``j * r`` to ``(j + 1) * r - 1``."""
        states = states.view(count, n, states.shape[1], states.shape[2]).transpose(1, 2)
        return states.repeat_interleave(heads // states.shape[1], dim=1) if states.shape[1] != heads else states

    q = _Rows.apply(flat(query), plan.queries, plan.slots, plan.real_positions)
    # a prompt's keys serve every response of its unit: a plain gather, whose gradient adds them up
    k, v = (flat(states).index_select(0, plan.keys) for states in (key, value))
    groups = plan.groups
    queries = q.split([count * n for count, n, _ in groups])
    keys, values = (t.split([count * n for count, _, n in groups]) for t in (k, v))
    outs = []
    for (count, n_queries, n_keys), q_k, k_k, v_k, mask in zip(groups, queries, keys, values, plan.masks):
        out = F.scaled_dot_product_attention(per_piece(q_k, count, n_queries), per_piece(k_k, count, n_keys),
                                             per_piece(v_k, count, n_keys), attn_mask=mask,
                                             dropout_p=dropout if module.training else 0.0, scale=scaling)
        outs.append(out.transpose(1, 2).reshape(count * n_queries, heads, out.shape[-1]))
    out = _Rows.apply(torch.cat(outs) if len(outs) > 1 else outs[0], plan.slots, plan.queries, plan.real_slots)
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
