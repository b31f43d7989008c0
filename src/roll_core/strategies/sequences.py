"""Token-level building blocks shared by every torch strategy: sampling and response log-probs.

Layout used everywhere in roll (the same as verl's): prompts are *left*-padded to ``[B, P]``,
responses are *right*-padded to ``[B, R]``, and a training sequence is their concatenation
``[B, P + R]``. ``response_mask`` is 1 for generated tokens up to and including EOS.

Sampling is a plain KV-cached loop rather than ``model.generate`` so that (a) the random draws come
from a ``torch.Generator`` the worker owns, which is what makes the ``local`` and ``ray`` executors
produce identical samples for the same seed, and (b) the sampler returns the log-probs of the tokens
it drew, which asynchronous training keeps for off-policy corrections.
"""

from __future__ import annotations

import inspect
from typing import Callable, Collection

import torch
import torch.nn.functional as F

from roll_core.multimodal import image_keys, model_images
from roll_core.strategies import float32_attention
from roll_core.strategies.kv_cache import in_place_cache


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: ``[0,0,0,1,2]`` for mask ``[0,0,1,1,1]``.  Shape ``[B, T]``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def forward_parameters(model) -> Collection[str]:
    """The keyword names the model's forward declares. A PEFT wrapper passes keywords through to its
    base model, so the base model's signature decides."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inspect.signature(base.forward).parameters


def cache_keyword(model) -> str:
    """The keyword ``model.forward`` takes its KV cache by: ``cache`` from transformers 5.24 (which
    warns on the old name and drops it in 5.40), ``past_key_values`` before. Outputs carry the cache
    under the same name."""
    return "cache" if "cache" in forward_parameters(model) else "past_key_values"


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                  images: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of the left-padded prompts ``[B, P]`` are one prompt: the same tokens under the mask and,
    where ``images`` ``[B, ...]`` are given, the same images (the same text over other images is
    another prompt). Returns ``first`` ``[G]``, the first sample of each distinct prompt in the order
    the prompts first come, and ``group`` ``[B]``, each sample's index into ``first``. The samples of
    a GRPO group share one; :func:`prefill` computes it once, packing
    (:mod:`roll_core.strategies.packing`) lays it out once per unit."""
    key = torch.where(prompt_mask.bool(), prompt_ids, -1)
    if images is not None:
        key = torch.cat([key, image_keys(images).to(key.device)[:, None]], dim=1)
    # rows as tuples in a dict: on the host, several times faster than torch.unique(dim=0)'s sort
    # at a step's [256, 24] (packing asks at every pass)
    numbers: dict[tuple[int, ...], int] = {}
    first: list[int] = []  # each prompt's first sample
    group: list[int] = []  # each sample's prompt
    for b, row in enumerate(key.tolist()):
        g = numbers.setdefault(tuple(row), len(numbers))
        if g == len(first):  # a prompt not seen before
            first.append(b)
        group.append(g)
    device = prompt_ids.device
    return torch.tensor(first, dtype=torch.long, device=device), torch.tensor(group, dtype=torch.long, device=device)


def prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, new_tokens: int = 0,
            images: torch.Tensor | None = None, image_counts: torch.Tensor | None = None):
    """The KV cache of left-padded prompts ``[B, P]`` and the logits of each one's next token ``[B, V]``;
    ``images`` ``[B, K, C, H, W]``: each prompt's images (:mod:`roll_core.multimodal`; of which the
    first ``image_counts[b]`` where given), read here only.

    The cache takes the ``new_tokens`` that follow in place (:mod:`roll_core.strategies.kv_cache`), in
    float32 where the decoding steps attend in float32 (:mod:`roll_core.strategies.float32_attention`).

    A prompt that comes several times (the samples of a GRPO group: the same tokens and images) is
    computed once and its cache copied to every sample: the same values, ``num_return_sequences``
    times less prompt compute. Only the last position's logits are computed where the model takes
    ``logits_to_keep`` (a full vocabulary at every prompt position is most of the memory of a long prompt)."""
    keep = {"logits_to_keep": 1} if "logits_to_keep" in forward_parameters(model) else {}
    first, group = prompt_groups(prompt_ids, prompt_mask, images)
    shared = len(first) < len(prompt_ids)
    if shared:  # the first sample of each distinct prompt stands for all of them
        prompt_ids, prompt_mask = prompt_ids[first], prompt_mask[first]
        images = None if images is None else images[first]
        image_counts = None if image_counts is None else image_counts[first]
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids_from_mask(prompt_mask),
                use_cache=True, **keep, **model_images(images, counts=image_counts))
    dtype = float32_attention.cache_dtype(model, prompt_ids.device)
    past = in_place_cache(out[cache_keyword(model)], new_tokens, dtype)
    logits = out.logits[:, -1, :].float()
    if shared:
        past.reorder_cache(group)
        logits = logits[group]
    return past, logits


def next_tokens(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                generator: torch.Generator | None = None, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's next token from its logits ``[B, V]``, and the token's log-probability under the
    sampling distribution ``softmax(logits / temperature)`` (before top-k and top-p: the distribution
    the trainer computes); returns ``([B], [B])``. ``temperature`` 0 is greedy decoding. The draw is
    from that distribution cut to its ``top_k`` heaviest tokens (0: all of them), then to the nucleus
    of ``top_p`` of what is left, in that order, as ``transformers`` and vLLM apply them.
    **Overwrites** ``logits``: they must be the caller's own.

    Everything happens in ``logits``' memory: at a real vocabulary a new ``[B, V]`` tensor can cost
    more than its arithmetic. 64 x 151,936 float32 is 39 MB, past glibc's largest mmap threshold, so
    in a process with glibc's defaults each one is fresh pages from the kernel: the division by the
    temperature, the ``softmax`` and the ``log_softmax`` took 15 ms each that way here, the in-place
    chain with the draw 6.5 ms. Where freed memory is kept (roll's CPU workers,
    :mod:`roll_core.runtime.host_memory`) the gain is 1.1-1.4x (``benchmarks/bench_next_token.py``). The
    token's log-probability is read from its weight, ``log(w / sum(w))``: ``log_softmax``'s value to
    float32 rounding."""
    if top_k < 0:
        raise ValueError(f"top_k must be 0 (all tokens) or more, got {top_k}")
    if temperature <= 0:
        token = logits.argmax(-1)
        return token, -token_weights_(logits, 1.0).sum(-1).log()  # the argmax's weight is exp(0)
    weights = token_weights_(logits, temperature)
    sums = block_sums(weights)
    totals = sums.sum(-1, keepdim=True)  # the log-probability's normaliser: the whole vocabulary
    if 0 < top_k < weights.shape[-1]:
        sums = top_k_weights_(weights, top_k)
    if top_p >= 1.0:
        token = draw_tokens(weights, generator, sums)
    else:
        token = nucleus_sampler(weights.device)(weights, sums.sum(-1, keepdim=True), top_p, generator)
    # a drawn token is one of the top k, whose weights top_k_weights_ left as they were
    return token, (weights.gather(-1, token[:, None]) / totals).log().squeeze(-1)


def top_k_weights_(weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-k sampling (Fan et al. 2018, "Hierarchical Neural Story Generation"): every weight of
    ``weights`` ``[B, V]`` lighter than its row's ``top_k``-th heaviest set to 0, in place (a tie with
    the ``top_k``-th stays, as in ``transformers``' top-k warper); returns what is left's
    :func:`block_sums`."""
    kth = weights.topk(top_k, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # [B, 1]
    weights.masked_fill_(weights < kth, 0.0)
    return block_sums(weights)


LOG2_E = 1.4426950408889634  # 1 / ln 2: exp(x) = 2 ** (x * LOG2_E)


def token_weights_(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``exp((logits - max) / temperature)`` per row of ``[B, V]``, written over ``logits``: the
    unnormalised sampling probabilities, at most 1 (the argmax), without overflow at any temperature.

    Computed as ``2 ** ((logits - max) * log2(e) / temperature)``: on the CPU torch's ``exp2`` takes
    under a third of its ``exp``'s time (0.9 against 3.1 ms over 64 x 151,936 here), and the change
    of base folds into the multiplication the temperature needs anyway. The subtraction is exact near
    the maximum, so the weights of the likely tokens carry one rounding in their exponent, as before."""
    logits.sub_(logits.amax(-1, keepdim=True))
    return logits.mul_(LOG2_E / temperature).exp2_()


NUCLEUS_CHUNK = 16_384  # vocabulary columns per pass of nucleus_tokens' masked sums: small temporaries


def nucleus_tokens(weights: torch.Tensor, totals: torch.Tensor, top_p: float,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``weights`` ``[B, V]`` (non-negative, ``totals`` ``[B, 1]`` their sums)
    from the row's nucleus, in proportion to weight; returns ``[B]``. Nucleus (top-p) sampling,
    Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration": the nucleus is the smallest
    set of heaviest tokens whose weight reaches ``top_p * total``, so a token belongs to it when the
    tokens heavier than it weigh less than that (the heaviest always does).

    By rejection instead of sorting the vocabulary (a sort of 64 x 151,936 took 370 ms here): draw from
    all the weights; a row whose token lies outside the nucleus sets every token no heavier than it to
    0 (they lie outside too) and draws again. Each draw is from a set that holds the whole nucleus, in
    proportion to weight, so the token accepted is distributed as the nucleus alone; and it lands
    inside with probability at least ``top_p``, so a row takes at most ``1 / top_p`` draws on average.
    The first check passes over every row; later rounds work on copies of the rows still drawing,
    usually a few, and leave ``weights`` as they were."""
    _check_top_p(top_p)
    drawn = draw_tokens(weights, generator)
    token = drawn.clone()  # each row's accepted draw, filled in round by round
    pending = torch.arange(len(weights), device=weights.device)  # the rows whose draw is not yet accepted
    left, bound = weights, top_p * totals
    while True:
        weight = left.gather(-1, drawn[:, None])  # [b, 1]
        outside = (_weight_above(left, weight) >= bound).squeeze(-1)
        token[pending] = drawn
        if not bool(outside.any()):
            return token
        pending, left, bound = pending[outside], left[outside], bound[outside]
        _zero_up_to(left, weight[outside])  # ``left`` is a copy now: the caller's weights stay whole
        drawn = draw_tokens(left, generator)


def sorted_nucleus_tokens(weights: torch.Tensor, totals: torch.Tensor, top_p: float,
                          generator: torch.Generator | None = None) -> torch.Tensor:
    """:func:`nucleus_tokens`' draw, arguments and nucleus, found by sorting each row: in descending
    order, the tokens whose heavier neighbours weigh less than ``top_p * total`` form a prefix, and the
    nucleus is every token at least as heavy as its last one (so tied tokens stay together, as by
    rejection). Then one draw from the weights outside it set to 0; ``weights`` stay as they were.

    The way on a GPU, where a sort of 64 x 151,936 takes about a millisecond and each of rejection's
    rounds waits for the device to say which rows are left: the decoding step took 1.9 ms this way
    and 3.6-3.7 ms by rejection on an H200 (``benchmarks/bench_next_token.py --device cuda``)."""
    _check_top_p(top_p)
    ordered = weights.sort(-1, descending=True).values
    heavier = ordered.cumsum(-1) - ordered  # [B, V]: the weight ahead of each place in the order
    last = (heavier < top_p * totals).sum(-1, keepdim=True) - 1  # [B, 1]: at least the first place
    return draw_tokens(torch.where(weights >= ordered.gather(-1, last), weights, 0.0), generator)


NucleusDraw = Callable[[torch.Tensor, torch.Tensor, float, "torch.Generator | None"], torch.Tensor]


def nucleus_sampler(device: torch.device) -> NucleusDraw:
    """The faster of the two nucleus draws on ``device``: :func:`nucleus_tokens` (by rejection) on the
    CPU, where sorting the vocabulary takes hundreds of milliseconds, :func:`sorted_nucleus_tokens`
    elsewhere, where a sort is fast and each of rejection's rounds waits for the device."""
    return nucleus_tokens if device.type == "cpu" else sorted_nucleus_tokens


def _check_top_p(top_p: float) -> None:
    """The nucleus draws' one argument check: a nucleus of ``top_p`` 0 or less would hold no token."""
    if not 0.0 < top_p:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _weight_above(weights: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """Each row's total weight strictly above its ``floor`` ``[B, 1]``, ``[B, 1]``; summed in column
    chunks so that no temporary is a full ``[B, V]``.

    Without branches: ``sign(w - floor)`` clamped at 0 is 1 above the floor and 0 elsewhere, and
    multiplies the weights. On the CPU ``torch.where`` and ``masked_fill`` choose element by element,
    and over 64 x 151,936 weights took 4.5 ms where the rows were peaked and 8-10 ms where they were
    nearly flat, against 2.7 ms for this, either way (``benchmarks/bench_next_token.py``)."""
    total = torch.zeros_like(floor)
    for part in weights.split(NUCLEUS_CHUNK, -1):
        total += (part - floor).sign_().clamp_(min=0).mul_(part).sum(-1, keepdim=True)
    return total


def _zero_up_to(weights: torch.Tensor, ceiling: torch.Tensor) -> None:
    """Set each row's weights at or below its ``ceiling`` ``[B, 1]`` to 0, in place, chunk by chunk."""
    for part in weights.split(NUCLEUS_CHUNK, -1):
        part.masked_fill_(part <= ceiling, 0.0)


DRAW_BLOCK = 256  # vocabulary entries per block of draw_tokens' first search (the fastest of 128-512 here)


def block_sums(weights: torch.Tensor) -> torch.Tensor:
    """Each row of ``weights`` ``[B, V]`` summed by blocks of ``DRAW_BLOCK`` columns (the last one may
    be shorter), in the weights' dtype: ``[B, ceil(V / DRAW_BLOCK)]``. Their row sums are the rows'
    totals, and :func:`draw_tokens` searches them first, so a caller that needs both passes over the
    vocabulary once. A float64 sum would convert every entry first: 40x slower."""
    rows, vocab = weights.shape
    if vocab <= DRAW_BLOCK:
        return weights.sum(-1, keepdim=True)
    whole = vocab // DRAW_BLOCK * DRAW_BLOCK
    sums = weights[:, :whole].reshape(rows, -1, DRAW_BLOCK).sum(-1)
    return sums if whole == vocab else torch.cat([sums, weights[:, whole:].sum(-1, keepdim=True)], -1)


def draw_tokens(weights: torch.Tensor, generator: torch.Generator | None = None,
                sums: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``weights`` ``[B, V]`` (non-negative, not necessarily normalised), drawn
    with probability proportional to its weight; returns ``[B]``.

    Inverse transform sampling: one uniform ``u ~ U[0, 1)`` per row, and the first token whose
    cumulative weight exceeds ``u`` times the row's total. A token of weight 0 (cut by top-p) is never
    drawn: its cumulative weight equals the one before it. Cumulative sums are in float64. A
    vocabulary of more than ``DRAW_BLOCK`` entries is searched in two steps, so that no pass over all
    of it is more than a sum: the block where the target falls (from the blocks' sums, ``sums``
    where the caller has them from :func:`block_sums`), then the token inside that block (from its
    cumulative weights).

    Why not ``torch.multinomial(weights, 1)``: for one sample it draws an exponential variate for
    every entry (``argmax(w / q)``, ``q ~ Exp(1)``), one after another on the CPU. At a real model's
    vocabulary that is a large part of a decoding step (``benchmarks/bench_token_draw.py``)."""
    vocab = weights.shape[-1]
    if vocab <= DRAW_BLOCK:  # one block: its cumulative weights are all the search needs
        cumulative = weights.double().cumsum(-1)
        return torch.searchsorted(cumulative, _targets(cumulative[:, -1:], generator), right=True).squeeze(-1)
    if sums is None:
        sums = block_sums(weights)  # [B, blocks]
    ends = F.pad(sums.double().cumsum(-1), (1, 0))  # [B, blocks + 1]: the weight before each block, and the total
    target = _targets(ends[:, -1:], generator)
    chosen = torch.searchsorted(ends[:, 1:].contiguous(), target, right=True)  # [B, 1]: the first block ending past it
    offsets = torch.arange(DRAW_BLOCK, device=weights.device)
    positions = chosen * DRAW_BLOCK + offsets  # [B, DRAW_BLOCK]; past the vocabulary in a short last block
    inside = weights.gather(-1, positions.clamp(max=vocab - 1)).double().masked_fill(positions >= vocab, 0)
    within = torch.searchsorted(inside.cumsum(-1), target - ends.gather(-1, chosen), right=True)
    # the block's sum and its cumulative weights round differently: a target at its very end takes
    # its last token of positive weight
    last = torch.where(inside > 0, offsets, -1).amax(-1, keepdim=True)
    return (chosen * DRAW_BLOCK + torch.minimum(within, last)).squeeze(-1)


def _targets(totals: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``u * total`` for each row's total weight ``[B, 1]`` and a uniform ``u``, strictly below the total."""
    if not bool(((totals > 0) & torch.isfinite(totals)).all()):
        raise ValueError("every row's weights must be finite, non-negative and not all zero")
    u = torch.rand(totals.shape, dtype=torch.float64, device=totals.device, generator=generator)
    return torch.minimum(u * totals, torch.nextafter(totals, torch.zeros_like(totals)))


def surviving_rows(going: torch.Tensor) -> torch.Tensor:
    """The rows still decoding after a step, in the order that moves the fewest KV-cache rows.

    ``going`` ``[B]`` is True for rows that continue. With ``k`` of them, the result ``[k]`` keeps
    each continuing row of the first ``k`` where it is and fills the places of the finished ones
    among them with the continuing rows from ``k`` on: ``[T, F, T, F, T, T] -> [0, 4, 2, 5]``.
    A cache that selects rows in place (:class:`~roll_core.strategies.kv_cache.GrowingLayer`) then
    copies one row per finished row, not every row after the first that finished."""
    kept = int(going.sum())
    order = torch.arange(kept, device=going.device)
    holes = (~going[:kept]).nonzero().squeeze(-1)
    return order.index_put_((holes,), going[kept:].nonzero().squeeze(-1) + kept)


# -- the ids that end and pad a response -------------------------------------------------------------
def token_ids(*values) -> list[int]:
    """Every id of ``values`` (each an id, a list of ids or None), in order, each once."""
    ids: list[int] = []
    for value in values:
        for i in [] if value is None else [value] if isinstance(value, int) else value:
            if int(i) not in ids:
                ids.append(int(i))
    return ids


def end_token_ids(config, generation_config=None) -> list[int]:
    """The ids that end a response of the model with this ``config`` and ``generation_config``: the
    ``eos_token_id`` of each (an id, a list of ids or None). Chat models often end a turn with an id
    besides the tokenizer's EOS and list every such id there: Llama 3.1 Instruct's config three
    (``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``), Qwen2.5 Instruct's generation config two.
    vLLM and SGLang stop at each of them as well."""
    return token_ids(getattr(config, "eos_token_id", None), getattr(generation_config, "eos_token_id", None))


def model_end_token_ids(directory) -> list[int]:
    """:func:`end_token_ids` of the model saved in ``directory``: the ``eos_token_id`` of its
    ``config.json`` (or of its ``text_config``, where a multimodal model keeps it) and of its
    ``generation_config.json`` when it has one. Read as JSON, not through ``AutoConfig``, which
    refuses an architecture of the model's own code unless told to run it."""
    import json
    from pathlib import Path

    def eos(name: str):
        path = Path(directory) / name
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        return config.get("eos_token_id", (config.get("text_config") or {}).get("eos_token_id"))

    return token_ids(eos("config.json"), eos("generation_config.json"))


def tokenizer_end_id(directory) -> int | None:
    """The EOS id of the tokenizer saved in ``directory``; None when the directory holds no tokenizer
    (a hub name, or a model saved without one) or the tokenizer names no EOS."""
    from pathlib import Path

    if not any((Path(directory) / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory)).eos_token_id


def response_end_ids(directory, tokenizer=None) -> list[int]:
    """Every id at which a response of the model saved in ``directory`` ends: the EOS of ``tokenizer``
    (else of the tokenizer saved with the model, :func:`tokenizer_end_id`), then the ids its files
    name (:func:`model_end_token_ids`). A tokenizer's EOS need not be among the config's: a model
    tuned to end its turns with a chat token often names it in the tokenizer alone. The hf engine,
    vLLM and SGLang stop at each of these ids, and the schedulers flag a full-length response that
    ends at none of them as truncated, so every engine ends responses where the others do."""
    eos = tokenizer.eos_token_id if tokenizer is not None else tokenizer_end_id(directory)
    return token_ids(eos, model_end_token_ids(directory))


def never_drawn(config) -> list[int]:
    """Ids a response must not contain: an image-text model's image token (``image_token_id``), which
    stands for an image's features wherever it is, so a response holding one would not fit its
    images. The model's full ``config``, not the text decoder's."""
    return token_ids(getattr(config, "image_token_id", None))


NEVER_LOGIT = -1e9  # finite: entropy sums p * log p, and 0 * -inf would be nan; any temperature keeps it finite


def without(logits: torch.Tensor, never: Collection[int]) -> torch.Tensor:
    """``logits`` ``[..., V]`` with the ids in ``never`` (:func:`never_drawn`) at :data:`NEVER_LOGIT`,
    so the log-probs, entropy and distributions computed from them are the sampler's, which never
    draws those ids. A new tensor (an in-place write on a model's output would escape autograd's
    and FSDP's hooks); the logits themselves where ``never`` is empty."""
    if not never:
        return logits
    return logits.index_fill(-1, torch.tensor(list(never), device=logits.device), NEVER_LOGIT)


def padding_id(config, generation_config=None) -> int:
    """The id that right-pads responses (always masked out): the ``pad_token_id`` of ``config``, else
    of ``generation_config``, else the first id that ends a response, else 0. Many models name no
    padding id (Llama 3's config has none)."""
    ids = token_ids(getattr(config, "pad_token_id", None), getattr(generation_config, "pad_token_id", None),
                    end_token_ids(config, generation_config))
    return ids[0] if ids else 0


@torch.no_grad()
def sample_responses(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | Collection[int] | None,
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    should_stop=None,
    images: torch.Tensor | None = None,
    image_counts: torch.Tensor | None = None,
    never: Collection[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Generate responses for left-padded prompts.

    Args:
        prompt_ids, prompt_mask: ``[B, P]`` left-padded prompts.
        images: ``[B, K, C, H, W]``, each prompt's images (None: text only), of which the first
            ``image_counts[b]`` ``[B]`` where given; see :func:`prefill`.
        never: ids never drawn (an image-text model's image token, :func:`never_drawn`): their
            logits are :data:`NEVER_LOGIT`, so the log-probs are those of the distribution without
            them, as the trainer's are (:func:`without`).
        eos_token_id: the id, or ids, that end a response (:func:`end_token_ids`); None: none do.
        temperature: 0 means greedy decoding.
        top_p, top_k: the nucleus and the number of heaviest tokens each draw keeps (1.0 and 0: all);
            see :func:`next_tokens`.
        should_stop: checked before every decoding step; when it returns True, decoding ends there
            (an aborted request: :func:`roll_core.strategy.request_cancelled`).
    Returns:
        ``(response_ids [B, R], response_mask [B, R], log_probs [B, R])`` with ``R <= max_new_tokens``;
        log-probs are those of the sampling distribution (after temperature, before top-k and top-p), 0 on
        padding.
    """
    batch = prompt_ids.shape[0]
    mask = prompt_mask.long()
    past, logits = prefill(model, prompt_ids, mask, max_new_tokens, images, image_counts)
    cache = cache_keyword(model)  # once: the signature does not change between decoding steps
    next_pos = mask.sum(-1, keepdim=True)
    device = prompt_ids.device
    ends = torch.tensor(token_ids(eos_token_id), dtype=torch.long, device=device)
    banned = torch.tensor(list(never), dtype=torch.long, device=device) if never else None
    # Finished rows leave the decoding batch (and its KV cache): ``rows`` maps the rows still decoding
    # to their place in the output, which starts as padding. The rows' order in the batch is free, so
    # the cache moves as few as it can (surviving_rows).
    rows = torch.arange(batch, device=device)
    tokens = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logps = torch.zeros(batch, max_new_tokens, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    steps = 0
    for step in range(max_new_tokens):
        if banned is not None:
            logits.index_fill_(1, banned, NEVER_LOGIT)  # in place: this step's own logits, no autograd
        token, logp = next_tokens(logits, temperature, top_p, generator, top_k)  # logits: this step's own
        tokens[rows, step], logps[rows, step], lengths[rows] = token, logp, step + 1
        steps = step + 1
        going = ~torch.isin(token, ends)
        if steps == max_new_tokens or not bool(going.any()) or (should_stop is not None and should_stop()):
            break  # the last token's own logits would go unused
        if not bool(going.all()):
            keep = surviving_rows(going)
            rows, token, mask, next_pos = rows[keep], token[keep], mask[keep], next_pos[keep]
            past.reorder_cache(keep)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos, use_cache=True,
                    **{cache: past})
        past = out[cache]
        logits = out.logits[:, -1, :].float()
        next_pos = next_pos + 1
    response_mask = (torch.arange(steps, device=device)[None, :] < lengths[:, None]).long()
    return tokens[:, :steps], response_mask, logps[:, :steps]


def response_log_probs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    with_distribution: bool = False,
):
    """Log-probs of the last ``response_length`` tokens of ``input_ids`` under ``model``.

    Args:
        input_ids, attention_mask: ``[B, P + R]`` prompt-then-response sequences.
        temperature: divides the logits, matching the distribution the sampler drew from.
    Returns:
        ``log_probs [B, R]``, or ``(log_probs, entropy [B, R] | None, log_dist [B, R, V] | None)``
        when ``with_entropy`` or ``with_distribution`` asks for the extras.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return log_probs_from_logits(out.logits, input_ids, response_length, temperature,
                                 with_entropy=with_entropy, with_distribution=with_distribution)


def log_probs_from_logits(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    with_distribution: bool = False,
):
    """:func:`response_log_probs` from a model's logits ``[B, P + R, V]`` (for engines whose models
    do not return a Hugging Face output)."""
    return token_log_probs(logits[:, -response_length - 1 : -1, :], input_ids[:, -response_length:], temperature,
                           with_entropy=with_entropy, with_distribution=with_distribution)


def token_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    with_distribution: bool = False,
):
    """Log-probs of ``targets`` ``[B, R]`` under ``logits`` ``[B, R, V]``, the logits that predict
    each target (already shifted by one), at ``temperature``; with the extras as in
    :func:`response_log_probs`."""
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    log_softmax = F.log_softmax(logits, dim=-1)
    logp = log_softmax.gather(-1, targets[..., None]).squeeze(-1)
    if not (with_entropy or with_distribution):
        return logp
    entropy = -(log_softmax.exp() * log_softmax).sum(-1) if with_entropy else None
    return logp, entropy, (log_softmax if with_distribution else None)


def causal_lm_outputs(logits: torch.Tensor, input_ids: torch.Tensor, response_length: int, wanted: Collection[str],
                      temperature: float, never: Collection[int] = ()) -> dict[str, torch.Tensor]:
    """The outputs a training strategy's ``forward`` names (``log_probs``, ``entropy``,
    ``log_dist``), as many as ``wanted`` asks for, from one pass's logits ``[B, P + R, V]``, with the
    ids in ``never`` out of the distribution (:func:`without`)."""
    return response_outputs(logits[:, -response_length - 1 : -1, :], input_ids[:, -response_length:], wanted,
                            temperature, never)


def response_outputs(response_logits: torch.Tensor, responses: torch.Tensor, wanted: Collection[str],
                     temperature: float, never: Collection[int] = ()) -> dict[str, torch.Tensor]:
    """:func:`causal_lm_outputs` from the logits that predict each response token ``[B, R, V]``
    (a packed pass's, gathered back: :meth:`roll_core.strategies.packing.PackedSequences.at_responses`).
    ``never`` is applied to these, the response positions' logits only (a copy of ``[B, R, V]``). A
    response token in ``never`` (an image token of an environment's reply in an agentic row: context,
    never a target) gets log-prob 0, as padding does, not the -1e9 its banned logit would give."""
    extras = "entropy" in wanted or "log_dist" in wanted
    response_logits = without(response_logits, never)
    out = token_log_probs(response_logits, responses, temperature,
                          with_entropy="entropy" in wanted, with_distribution="log_dist" in wanted)
    logp, entropy, log_dist = out if extras else (out, None, None)
    if never:
        logp = logp.masked_fill(torch.isin(responses, torch.tensor(list(never), device=responses.device)), 0.0)
    found = {"log_probs": logp, "entropy": entropy, "log_dist": log_dist}
    return {name: found[name] for name in wanted}


# -- for engines that take and return token lists (vLLM, SGLang) ------------------------------------
def prompt_token_lists(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """The left-padded prompts ``[B, P]`` as one token list per row, padding dropped."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]


def right_pad(rows: list[list[float]] | list[list[int]], value, dtype: torch.dtype) -> torch.Tensor:
    """Rows of different lengths as one right-padded ``[B, max length]`` tensor."""
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=dtype).reshape(len(rows), width)


def packed_responses(tokens: list[list[int]], log_probs: list[list[float]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """An engine's sampled tokens and their log-probs as ``responses``, ``response_mask`` and
    ``infer_log_probs`` ``[B, R]`` (right-padded; an empty row is an aborted request)."""
    return {"responses": right_pad(tokens, pad_token_id, torch.long),
            "response_mask": right_pad([[1] * len(t) for t in tokens], 0, torch.long),
            "infer_log_probs": right_pad(log_probs, 0.0, torch.float32)}


def rescaled_log_probs(raw: torch.Tensor, targets: list[int], temperature: float,
                       distribution: bool) -> torch.Tensor:
    """Log-probs at ``temperature`` from an engine's full-vocabulary log-probs at temperature 1.

    ``raw`` ``[n, V]`` is ``log_softmax(logits)``, so ``log_softmax(raw / T) = log_softmax(logits / T)``
    (the log-normaliser is a constant per row). Returns the full ``[n, V]`` with ``distribution``,
    else the ``targets``' ``[n]``."""
    log_dist = torch.log_softmax(raw / (temperature or 1.0), -1)
    if distribution:
        return log_dist
    return log_dist.gather(-1, torch.tensor(targets, dtype=torch.long)[:, None]).squeeze(-1)
