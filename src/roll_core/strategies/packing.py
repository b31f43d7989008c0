"""Sequences packed without padding, each group's shared prompt computed once.

Why: an RL batch is ``prompts_per_step x num_return_sequences`` samples, and the samples of a group
share their prompt. The padded layout (:mod:`roll_core.strategies.sequences`) computes every row at
the batch's widest prompt plus its longest response, and every group's prompt once per sample.
When responses are short next to their width, or prompts long next to the responses, most of that
compute is padding and repetition. Here a *unit* is one prompt followed by the responses of its
group that fit in a row; each response attends to the prompt and to itself only, at the positions it
would have alone, so every response token gets the same logits as in the padded layout (up to float
rounding: the matrix kernels see other shapes). Models that run ``sdpa`` compute that attention piece
by piece (:mod:`roll_core.strategies.packed_attention`), others densely over each row with a 4-D mask.
Responses are packed first-fit into rows, a group's prompt repeated in each row its responses reach:

    padded (B rows of P + R)              packed (N rows of W)
    [pad pad p1 p2 | r1 r1 pad]           [p1 p2 | r1 r1 | r2 r2 r2 | r3 | q1 q2 q3 | s1 s1 pad ...]
    [pad pad p1 p2 | r2 r2 r2 ]            <------ one unit ------->   <--- next unit ---->
    [pad pad p1 p2 | r3 pad pad]

A row is as wide as the longest sample alone, or as ``max_length`` where the largest group needs
it, then narrowed while the rows stay as few: attention is computed densely over a row, so
``max_length`` bounds what dense attention costs per token. The attention mask is 4-D (``[N, 1, W, W]``):
transformers passes such a mask through as given, as a boolean mask to ``sdpa`` and an additive one to
``eager``.

Used by the torch strategies' forward passes (``hf``, ``fsdp2``, ``deepspeed``, roll-megatron's) when a role's
``pack_sequences`` is on (the default where the strategy supports it). Measured in
``docs/benchmarks.md`` (``benchmarks/bench_packing.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roll_core.multimodal import batch_images, model_images
from roll_core.strategies import packed_attention
from roll_core.strategies.sequences import prompt_groups

# transformers' attention implementations that take a custom 4-D mask (roll's piece-by-piece one is
# sdpa when it is given no plan)
MASKED_ATTENTION = ("sdpa", "eager", packed_attention.ATTENTION)


@dataclass(frozen=True)
class PackedSequences:
    """A batch's sequences packed into ``N`` rows of ``W`` tokens.

    ``input_ids``, ``position_ids`` ``[N, W]``; ``units`` ``[N, W]`` numbers the unit (prompt plus
    responses) each token belongs to, -1 on padding; ``branches`` ``[N, W]`` is 0 on a unit's prompt
    and ``k`` on its ``k``-th response. ``source`` ``[B, R]`` is, for each response token of the
    padded layout, the flat index (row * W + column) of the position whose logits predict it; a
    token the batch does not have (``response_mask`` 0) points at position 0 and must stay masked.
    ``pieces`` ``[G, 4]``: each unit's prompt and each response as a run of positions (flat start,
    length) with its unit's prompt (flat start, length; 0 on a prompt), for attention piece by piece.
    ``unit_samples`` ``[U]``: for each unit, in the order units come (row by row), a sample whose
    prompt it carries: the one whose images the unit's image tokens stand for."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    units: torch.Tensor
    branches: torch.Tensor
    source: torch.Tensor
    pieces: torch.Tensor
    unit_samples: torch.Tensor

    @property
    def tokens(self) -> int:
        """Positions a forward pass over the rows computes (padding included)."""
        return self.input_ids.numel()

    def attention_mask(self, implementation: str, dtype: torch.dtype) -> torch.Tensor:
        """``[N, 1, W, W]``: token ``i`` sees token ``j <= i`` of its own unit when ``j`` is on the
        prompt or on ``i``'s own response. Padding sees itself only (no empty softmax row, so no NaN).
        Boolean for ``sdpa``; 0 / most-negative additive for ``eager``."""
        if implementation not in MASKED_ATTENTION:
            raise ValueError(f"packed sequences need attention that takes a 4-D mask ({', '.join(MASKED_ATTENTION)}); "
                             f"the model uses {implementation!r}")
        width = self.input_ids.shape[1]
        column = torch.arange(width)
        causal = column[None, :] <= column[:, None]
        same_unit = self.units[:, :, None] == self.units[:, None, :]
        visible = (self.branches[:, None, :] == 0) | (self.branches[:, :, None] == self.branches[:, None, :])
        allowed = (same_unit & visible & causal) | torch.eye(width, dtype=torch.bool)
        allowed = allowed[:, None]
        if implementation != "eager":
            return allowed
        blocked = torch.zeros(allowed.shape, dtype=dtype)
        return blocked.masked_fill(~allowed, torch.finfo(dtype).min)

    def at_responses(self, per_position: torch.Tensor) -> torch.Tensor:
        """``[N, W, ...]`` values per packed position as ``[B, R, ...]``: those that predict each response token."""
        flat = per_position.reshape(-1, *per_position.shape[2:])
        return flat[self.source.to(flat.device)]


def pack_sequences(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
                   response_mask: torch.Tensor, *, max_length: int, pad_token_id: int,
                   images: torch.Tensor | None = None) -> PackedSequences:
    """Pack left-padded prompts ``[B, P]`` and right-padded responses ``[B, R]`` (the padded layout)
    into rows of at most ``W = max(longest sample, min(max_length, largest group))`` tokens; where
    the last rows would be part empty, the rows are narrowed as far as their number stays the same.

    Samples with one prompt (equal tokens, and equal ``images`` where given:
    :func:`roll_core.strategies.sequences.prompt_groups`) share it in each unit. Groups go longest
    first (in the order they come where equally long); each response joins its group's open unit
    while that row has room, and otherwise opens a unit (the prompt repeated) in the first row with
    room for both. The inputs may be on any
    device; the packed tensors are on the CPU (:func:`packed_forward` moves them)."""
    # the layout is worked out on the host, in Python lists; a batch already on a GPU comes back once
    prompt_ids, prompt_mask, responses, response_mask = (t.cpu() for t in (prompt_ids, prompt_mask, responses,
                                                                           response_mask))
    batch, width_r = responses.shape
    width_p = prompt_ids.shape[1]
    prompt_lengths, lengths = prompt_mask.sum(-1), response_mask.sum(-1)
    if not torch.equal(response_mask.bool(), torch.arange(width_r)[None, :] < lengths[:, None]):
        raise ValueError("response_mask must be 1 on a prefix of each response (right padding only)")
    if not torch.equal(prompt_mask.bool(), torch.arange(width_p)[None, :] >= (width_p - prompt_lengths)[:, None]):
        raise ValueError("prompt_mask must be 1 on a suffix of each prompt (left padding only)")
    if bool((prompt_lengths == 0).any()):
        raise ValueError("every sample needs a prompt of at least one token (the first response token's logits)")
    # Python lists once: slicing them is far cheaper than one tensor index per sample
    tokens = [tuple(row[width_p - n:]) for row, n in zip(prompt_ids.tolist(), prompt_lengths.tolist())]
    answers = [row[:n] for row, n in zip(responses.tolist(), lengths.tolist())]
    groups: dict[int, list[int]] = {}  # each prompt's samples, the prompts numbered as they first come
    for b, prompt in enumerate(prompt_groups(prompt_ids, prompt_mask, images)[1].tolist()):
        groups.setdefault(prompt, []).append(b)
    length = {prompt: len(tokens[members[0]]) for prompt, members in groups.items()}
    alone = max(len(p) + len(a) for p, a in zip(tokens, answers))
    together = max(length[p] + sum(len(answers[b]) for b in members) for p, members in groups.items())
    width = max(alone, min(max_length, together))

    totals = {prompt: length[prompt] + sum(len(answers[b]) for b in members) for prompt, members in groups.items()}
    order = sorted(groups, key=lambda p: -totals[p])
    rows = _fill_rows(order, groups, answers, width, length)
    content = sum(totals.values())
    if len(rows) * width > 1.05 * content:  # the last rows are part empty: narrow every row while as few suffice
        low = max(alone, -(-content // len(rows)))
        while low < width:
            middle = (low + width) // 2
            narrower = _fill_rows(order, groups, answers, middle, length)
            if len(narrower) <= len(rows):
                rows, width = narrower, middle
            else:
                low = middle + 1

    ids, positions, unit_of, branch_of = [], [], [], []
    pieces: list[tuple[int, int, int, int]] = []
    unit_samples: list[int] = []
    source = [[0] * width_r for _ in range(batch)]
    next_unit = 0
    for r, row in enumerate(rows):
        row_ids: list[int] = []
        row_pos: list[int] = []
        row_unit: list[int] = []
        row_branch: list[int] = []
        for _, members in row:
            prompt = tokens[members[0]]
            unit_id, next_unit = next_unit, next_unit + 1
            unit_samples.append(members[0])
            prompt_start = r * width + len(row_ids)
            pieces.append((prompt_start, len(prompt), prompt_start, 0))
            row_ids += prompt
            row_pos += range(len(prompt))
            row_unit += [unit_id] * len(prompt)
            row_branch += [0] * len(prompt)
            last_prompt = r * width + len(row_ids) - 1
            for k, b in enumerate(members, start=1):
                n = len(answers[b])
                start = r * width + len(row_ids)
                # token t is predicted at the position before it: the prompt's last, then the answer's own
                source[b][:n] = [last_prompt, *range(start, start + n - 1)][:n]
                if n:
                    pieces.append((start, n, prompt_start, len(prompt)))
                row_ids += answers[b]
                row_pos += range(len(prompt), len(prompt) + n)
                row_unit += [unit_id] * n
                row_branch += [k] * n
        pad = width - len(row_ids)
        ids.append(row_ids + [pad_token_id] * pad)
        positions.append(row_pos + list(range(pad)))
        unit_of.append(row_unit + [-1] * pad)
        branch_of.append(row_branch + [0] * pad)
    return PackedSequences(input_ids=torch.tensor(ids, dtype=torch.long),
                           position_ids=torch.tensor(positions, dtype=torch.long),
                           units=torch.tensor(unit_of, dtype=torch.long),
                           branches=torch.tensor(branch_of, dtype=torch.long),
                           source=torch.tensor(source, dtype=torch.long),
                           pieces=torch.tensor(pieces, dtype=torch.long),
                           unit_samples=torch.tensor(unit_samples, dtype=torch.long))


def _fill_rows(order: list[int], groups: dict[int, list[int]], answers: list[list[int]],
               width: int, length: dict[int, int]) -> list[list[tuple[int, list[int]]]]:
    """Each row's units ``(prompt, samples)``, first fit response by response: a group's responses
    join its open unit while its row has room; the next one opens a unit (its prompt repeated) in the
    first row with room for both, so groups of uneven length share rows instead of each padding a
    row to the widest. Groups are taken in ``order``; ``length`` is each group's prompt length."""
    rows: list[list[tuple[int, list[int]]]] = []
    used: list[int] = []
    for prompt in order:
        open_row: int | None = None
        for b in groups[prompt]:
            n = len(answers[b])
            if open_row is not None and used[open_row] + n <= width:
                rows[open_row][-1][1].append(b)  # the row's last unit: this group's, opened just before
                used[open_row] += n
                continue
            need = length[prompt] + n
            open_row = next((r for r, filled in enumerate(used) if filled + need <= width), None)
            if open_row is None:
                open_row = len(rows)
                rows.append([])
                used.append(0)
            rows[open_row].append((prompt, [b]))
            used[open_row] += need
    return rows


def model_config(model):
    """The Hugging Face config of ``model``'s text decoder (an image-text model's ``text_config``),
    or of the model an engine wraps (DeepSpeed's engine has a ``config`` of its own and the model in
    ``module``)."""
    config = getattr(model, "config", None)
    if not (hasattr(config, "pad_token_id") or hasattr(config, "get_text_config")) and hasattr(model, "module"):
        return model_config(model.module)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _image_token(model) -> int | None:
    """The image token of an image-text ``model`` (its top config's, not its decoder's), None for a
    text model; through an engine that wraps the model (DeepSpeed's ``module``)."""
    config = getattr(model, "config", None)
    if not hasattr(config, "image_token_id") and hasattr(model, "module"):
        return _image_token(model.module)
    return getattr(config, "image_token_id", None)


def _attention(model) -> str:
    return getattr(model_config(model), "_attn_implementation", None) or "eager"


def packed_inputs(model, batch, role_config) -> PackedSequences | None:
    """``batch`` (the padded layout) packed for ``model``, or None where it runs padded: the role's
    ``pack_sequences`` is off, or is left unset (None) and the model's attention takes no 4-D mask
    or the batch's responses hold images. Set on (True) with such a model or batch, it is an error."""
    wanted = getattr(role_config, "pack_sequences", None)
    config = model_config(model)
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if wanted is False or (wanted is None and implementation not in MASKED_ATTENTION):
        return None
    # An agentic episode's responses may hold images (the environment's replies); a packed unit
    # hands its model pass only its prompt's
    image_token = _image_token(model)
    if image_token is not None and batch_images(batch) is not None and bool((batch["responses"] == image_token).any()):
        if wanted:
            raise ValueError("pack_sequences: true, but the batch's responses hold images (an environment's image "
                             "observations), which packed rows do not take. Set pack_sequences: false")
        return None
    if implementation not in MASKED_ATTENTION:
        raise ValueError(f"pack_sequences: true needs attention that takes a 4-D mask ({', '.join(MASKED_ATTENTION)}); "
                         f"the model uses {implementation!r}. Set pack_sequences: false")
    # A custom mask replaces the model's own, sliding window included: only pack where no sequence reaches it
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    longest = int(batch.sample_tokens().max())
    if isinstance(window, int) and longest > window:
        if wanted:
            raise ValueError(f"pack_sequences: true, but a sequence of {longest} tokens passes the model's sliding "
                             f"window ({window}), which the packed mask would not apply. Set pack_sequences: false")
        return None
    return pack_batch(batch, role_config, config.pad_token_id)


def pack_batch(batch, role_config, pad_token_id: int | None) -> PackedSequences:
    """``batch``'s padded layout packed as ``role_config`` says (``pack_max_length``), padding with
    ``pad_token_id`` (0 where the model has none): what a strategy that has decided to pack calls."""
    return pack_sequences(batch["prompt_ids"], batch["prompt_mask"], batch["responses"], batch["response_mask"],
                          max_length=int(getattr(role_config, "pack_max_length", 1024)), pad_token_id=pad_token_id or 0,
                          images=batch_images(batch))


def packed_forward(model, packed: PackedSequences, device: torch.device, images: torch.Tensor | None = None,
                   counts: torch.Tensor | None = None):
    """The model's output on ``packed``'s rows (``use_cache`` off). A model on ``sdpa`` attends piece
    by piece (:mod:`roll_core.strategies.packed_attention`) where that pays (wide rows, on the CPU);
    the dense mask goes along for layers that cannot. ``images`` ``[B, K, C, H, W]``: the batch's
    (:mod:`roll_core.multimodal`; of which the first ``counts[b]`` where given), of which each
    unit's prompt reads its sample's."""
    plan = {}
    dtype = next(model.parameters()).dtype
    rows, width = packed.input_ids.shape
    by_pieces = packed_attention.pays_off(packed.pieces, rows, width, device)
    if by_pieces and packed_attention.adopt(model, model_config(model)):
        plan[packed_attention.PLAN_KEYWORD] = (packed_attention.attention_plan(packed.pieces, packed.tokens)
                                               .to(device, dtype))
    mask = packed.attention_mask(_attention(model), dtype)
    pixels = model_images(None if images is None else images[packed.unit_samples], device,
                          None if counts is None else counts[packed.unit_samples])
    return model(input_ids=packed.input_ids.to(device), attention_mask=mask.to(device),
                 position_ids=packed.position_ids.to(device), use_cache=False, **plan, **pixels)
