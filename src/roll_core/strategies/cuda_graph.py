"""Decoding steps replayed from a CUDA graph: the ``hf`` strategy's generation on a GPU
(``strategy_options.cuda_graphs``, on by default; nothing changes on the CPU).

Why: on a GPU a small model's decoding step is bound by the host, not by the device. At 95M
parameters (64 rows, one NVIDIA H200) a step took 9 ms, of which the GPU computed under 2 ms: the
rest was the ~385 kernels of the model's forward, each launched through Python and torch's
dispatcher. A CUDA graph records those kernels once and launches them all with one call, as vLLM
and SGLang do for their decoding steps: generation 3.0x faster there, 1.3x on the tiny model
(``docs/benchmarks.md``; ``python benchmarks/bench_sampling.py --device cuda --size large``).

How: a graph replays fixed shapes at fixed addresses, so the decoding batch is fixed.

- The KV cache holds every position the generation can reach from the start (:class:`FixedLayer`),
  and a step writes the position that a device tensor names, in place.
- The attention mask is a 4-D boolean tensor over all those positions. The column of the position a
  step writes is switched on before the step; positions not written yet stay masked out.
- Finished rows stay in the batch (their tokens are discarded), where the eager sampler
  (:func:`roll_core.strategies.sequences.sample_responses`) drops them.

The model's forward is captured once per generate call, after one pass on a side stream (CUDA's
libraries initialise lazily, which a capture cannot record), then replayed for every step. Sampling
(:func:`~roll_core.strategies.sequences.next_tokens`) runs eagerly on the graph's logits; the next
token, its position ids and the write position are copied into the graph's inputs before each replay.

Where it applies (:func:`supported`): CUDA, models on ``sdpa`` attention (which takes a boolean mask
as it is) whose cache layers are transformers' plain ``DynamicLayer``. Sliding-window, quantized or
linear-attention caches, other attention implementations, and the CPU decode eagerly. A model whose
forward waits on the device (a data-dependent branch) cannot be captured: the capture's error is
raised as :class:`CaptureFailed`, and the strategy goes on without graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from pydantic import Field
from transformers.cache_utils import DynamicLayer

from roll_core.strategies.kv_cache import GrowingLayer
from roll_core.strategies.precision import TorchOptions
from roll_core.strategies.sequences import cache_keyword, next_tokens, prefill, token_ids


class InferOptions(TorchOptions):
    """``roles.<role>.strategy_options`` of the ``hf`` inference strategy: the torch strategies' own,
    and whether its decoding steps are replayed from CUDA graphs."""

    cuda_graphs: bool = Field(True, description="on a GPU, replay each decoding step's forward pass from a CUDA "
                              "graph captured once per generate call (sdpa attention; the CPU decodes eagerly)")


def options(role_config) -> InferOptions:
    """The inference role's validated options (``roll validate`` checked them before any worker started)."""
    return InferOptions.model_validate(getattr(role_config, "strategy_options", None) or {})


class CaptureFailed(RuntimeError):
    """The model's decoding step could not be recorded as a CUDA graph (its forward synchronised
    with the host, say); the strategy decodes eagerly from then on."""


class FixedLayer(DynamicLayer):
    """A cache layer with room for every position of a generation ``[B, H, total, D]``, the prompt's
    first, in the prompt's dtypes. :meth:`update` writes the positions from ``at`` (a ``[1]`` long
    tensor on the device, which the sampler advances between steps) and returns the whole buffers:
    the mask hides what is not written yet."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, total: int, at: torch.Tensor):
        super().__init__()
        self._key_buffer, self._value_buffer = self._room(keys, total), self._room(values, total)
        self.keys, self.values = self._key_buffer, self._value_buffer
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.at = at

    @staticmethod
    def _room(filled: torch.Tensor, total: int) -> torch.Tensor:
        buffer = filled.new_zeros(*filled.shape[:-2], total, filled.shape[-1])
        buffer[..., : filled.shape[-2], :] = filled
        return buffer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # in the prefill's dtypes: under autocast the rotary embedding can leave keys in float32 and
        # values in bfloat16, and index_copy_ does not cast
        self._key_buffer.index_copy_(2, self.at, key_states.to(self._key_buffer.dtype))
        self._value_buffer.index_copy_(2, self.at, value_states.to(self._value_buffer.dtype))
        return self._key_buffer, self._value_buffer

    def get_seq_length(self) -> int:
        return self._key_buffer.shape[-2]


def supported(model, device: torch.device) -> bool:
    """Whether :func:`sample_responses` may capture ``model``'s decoding steps on ``device``: CUDA and
    ``sdpa`` attention (the cache's layers are checked after the prefill)."""
    config = getattr(model, "config", None)
    return device.type == "cuda" and getattr(config, "_attn_implementation", None) == "sdpa"


def fixed_cache(past, total: int, at: torch.Tensor):
    """``past`` (a prefilled cache) with each layer replaced by a :class:`FixedLayer` of ``total``
    positions, or None when a layer is of another kind (sliding-window, quantized, ...)."""
    layers = getattr(past, "layers", None)
    if not layers or not all(type(layer) in (DynamicLayer, GrowingLayer) and layer.keys is not None
                             and layer.keys.dim() == 4 for layer in layers):
        return None
    for i, layer in enumerate(layers):
        layers[i] = FixedLayer(layer.keys, layer.values, total, at)
    return past


class Replay:
    """``step()`` on its first call captured into a CUDA graph (after one pass on a side stream), then
    replayed; each call returns the step's output, the graph's own tensor from the second call on."""

    def __init__(self, step: Callable[[], torch.Tensor]):
        self.step = step
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            return self._capture()
        self.graph.replay()
        assert self.out is not None
        return self.out

    def _capture(self) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # what initialises lazily (cuBLAS workspaces, kernels) does it here
            first = self.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: other threads of the worker (weight sync, logging) may use CUDA meanwhile
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.out = self.step()
        except RuntimeError as error:
            raise CaptureFailed(f"the decoding step could not be captured as a CUDA graph: {error}") from error
        self.graph = graph
        return first  # the side pass computed this step; the graph's first replay is the next step


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
    capture: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`roll_core.strategies.sequences.sample_responses` over a fixed batch, its decoding steps
    replayed from a CUDA graph (``capture``; default: on CUDA). Same arguments and results; None when
    the prefilled cache is of a kind a fixed buffer cannot stand for (the caller decodes eagerly).
    With ``capture=False`` the same steps run eagerly: the CPU's tests check the bookkeeping that way.
    Raises :class:`CaptureFailed` when the model's step cannot be captured."""
    batch, width = prompt_ids.shape
    device = prompt_ids.device
    capture = device.type == "cuda" if capture is None else capture
    # no room to grow: the fixed layers copy the prompt's cache into buffers of their own
    past, logits = prefill(model, prompt_ids, prompt_mask)
    at = torch.zeros(1, dtype=torch.long, device=device)  # the cache position a step writes
    total = width + max_new_tokens - 1  # the last token is never fed back, so its position needs no room
    if fixed_cache(past, total, at) is None:
        return None
    attend = torch.zeros(batch, 1, 1, total, dtype=torch.bool, device=device)
    attend[:, 0, 0, :width] = prompt_mask.bool()
    first_position = prompt_mask.long().sum(-1, keepdim=True)  # left padding: a row's first new position
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    positions = first_position.clone()
    cache = cache_keyword(model)

    def step() -> torch.Tensor:
        out = model(input_ids=ids, attention_mask=attend, position_ids=positions, use_cache=True, **{cache: past})
        return out.logits[:, -1, :].float()

    run = Replay(step) if capture else step
    ends = torch.tensor(token_ids(eos_token_id), dtype=torch.long, device=device)
    tokens = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logps = torch.zeros(batch, max_new_tokens, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    steps = 0
    for step_index in range(max_new_tokens):
        token, logp = next_tokens(logits, temperature, top_p, generator, top_k)
        going = ~done
        tokens[:, step_index] = torch.where(going, token, pad_token_id)
        logps[:, step_index] = logp * going
        lengths += going
        done |= torch.isin(token, ends)
        steps = step_index + 1
        if steps == max_new_tokens or bool(done.all()) or (should_stop is not None and should_stop()):
            break
        ids.copy_(token[:, None])
        torch.add(first_position, step_index, out=positions)
        at.fill_(width + step_index)
        attend[:, :, :, width + step_index] = True
        logits = run()
    response_mask = (torch.arange(steps, device=device)[None, :] < lengths[:, None]).long()
    return tokens[:, :steps], response_mask, logps[:, :steps]
