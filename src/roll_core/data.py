"""``Batch``: the one container that moves between roles, and the data sources that feed it.

A batch is a dict of tensors sharing the first dimension plus a dict of per-row Python lists
(prompt text, ground truth, domain, group id, ...). It pickles cleanly, so the same object travels
through the ``local`` executor and Ray's object store. Its CPU tensors pickle as numpy arrays, which
pickle protocol 5 (Ray's) carries as out-of-band buffers, and come back as tensors over the same
memory: a quickstart-sized batch's Ray round trip took 7.7 ms against 19.5 ms with torch's own tensor
pickling (``benchmarks/bench_batch_transfer.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from roll_core.errors import ConfigError
from roll_core.multimodal import resolve_paths, with_image_fields


def even_slices(length: int, n: int) -> list[slice]:
    """``n`` contiguous, near-equal slices of ``range(length)`` (the first ``length % n`` one longer)."""
    size, rem = divmod(length, n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < rem else 0)
        out.append(slice(start, end))
        start = end
    return out


def _to_wire(tensor: torch.Tensor):
    """A CPU tensor as a numpy array over its memory; a tensor numpy cannot hold (a GPU one,
    bfloat16) as it is."""
    if tensor.device.type != "cpu":
        return tensor
    try:
        return tensor.detach().contiguous().numpy()
    except TypeError:  # a dtype numpy lacks
        return tensor


def _from_wire(value) -> torch.Tensor:
    if not isinstance(value, np.ndarray):
        return value
    # Ray hands large arrays over read-only shared memory; a tensor must be writable
    return torch.from_numpy(value if value.flags.writeable else value.copy())


def _unpickle_batch(tensors: dict, non_tensors: dict) -> "Batch":
    return Batch({k: _from_wire(v) for k, v in tensors.items()}, non_tensors)


# The tensors of roll's layout that are padded on the left (``roll_core.strategies.sequences``):
# a prompt's last token sits next to its response's first in every row
LEFT_PADDED = ("prompt_ids", "prompt_mask")


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, list] = field(default_factory=dict)

    def __reduce__(self):
        return _unpickle_batch, ({k: _to_wire(v) for k, v in self.tensors.items()}, self.non_tensors)

    def __len__(self) -> int:
        for value in (*self.tensors.values(), *self.non_tensors.values()):
            return len(value)  # type: ignore[arg-type]  # tensors and lists both have a length
        return 0

    def __getitem__(self, key: str):
        return self.tensors[key] if key in self.tensors else self.non_tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def sample_tokens(self) -> torch.Tensor:
        """Each sample's prompt plus response tokens, padding left out ``[B]``: what a packed pass
        computes for it and what token-sized micro-batches count."""
        return self.tensors["prompt_mask"].sum(-1) + self.tensors["response_mask"].sum(-1)

    def update(self, **items: Any) -> "Batch":
        for key, value in items.items():
            (self.tensors if isinstance(value, torch.Tensor) else self.non_tensors)[key] = value
        return self

    def select(self, index) -> "Batch":
        """Rows at ``index`` (a slice, list of ints or bool tensor)."""
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            index = index.nonzero().flatten().tolist()
        if isinstance(index, slice):
            index = list(range(len(self)))[index]
        idx = torch.as_tensor(index, dtype=torch.long)
        return Batch(
            {k: v[idx] for k, v in self.tensors.items()},
            {k: [v[i] for i in index] for k, v in self.non_tensors.items()},
        )

    def chunk(self, n: int) -> list["Batch"]:
        """``n`` contiguous, near-equal parts (for dispatching to ``n`` workers)."""
        return [self.select(s) for s in even_slices(len(self), n)]

    def split(self, size: int) -> list["Batch"]:
        """Consecutive parts of at most ``size`` rows (micro-batches)."""
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    @staticmethod
    def concat(batches: list["Batch"]) -> "Batch":
        """Inverse of :meth:`chunk`, and the join of batches encoded apart (a step's groups, rounds of
        dynamic sampling): tensors of different sizes past the first dimension are padded with
        zeros, prompts (:data:`LEFT_PADDED`) at the start of a row and everything else at the end
        (responses of other widths; images of rows that hold fewer). Parts of a batch of image
        prompts may hold other numbers of images or none (text prompts):
        :func:`~roll_core.multimodal.with_image_fields` gives each part the images' fields first."""
        batches = [b for b in batches if len(b)]
        if not batches:
            return Batch()
        parts_of = with_image_fields([b.tensors for b in batches], [len(b) for b in batches])
        tensors = {key: torch.cat(_padded([part[key] for part in parts_of], left=key in LEFT_PADDED))
                   for key in parts_of[0]}
        non = {k: [x for b in batches for x in b.non_tensors[k]] for k in batches[0].non_tensors}
        return Batch(tensors, non)


def _padded(parts: list[torch.Tensor], left: bool = False) -> list[torch.Tensor]:
    """``parts`` zero-padded to the largest size in every dimension past the first: at the end, or
    with ``left`` at the start of the last dimension (``[B, P]`` left-padded prompts)."""
    shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    out = []
    for p in parts:
        if list(p.shape[1:]) != shape:
            grown = p.new_zeros(len(p), *shape)
            where = [slice(0, n) for n in p.shape[1:]]
            if left:
                where[-1] = slice(shape[-1] - p.shape[-1], shape[-1])
            grown[(slice(None), *where)] = p
            p = grown
        out.append(p)
    return out


def read_jsonl(path: str | Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"data file '{path}' line {lineno}: invalid JSON ({exc.msg})") from None
            if "prompt" not in row and "messages" not in row:
                raise ConfigError(f"data file '{path}' line {lineno}: missing key 'prompt' (or 'messages', a conversation)")
            rows.append(resolve_paths(row, Path(path).parent))
    if not rows:
        raise ConfigError(f"data file '{path}' has no rows")
    return rows


class PromptStream:
    """An endless, resumable stream of training rows.

    Each epoch is a permutation seeded by ``(seed, epoch)``; the position is ``(epoch, index)``, so
    ``state()``/``load_state()`` resume exactly where a killed run stopped.
    """

    def __init__(self, rows: list[dict], seed: int):
        self.rows, self.seed = rows, seed
        self.epoch, self.index = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(len(self.rows), generator=g).tolist()

    def next(self, n: int) -> list[dict]:
        out: list[dict] = []
        while len(out) < n:
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation()
            out.append(self.rows[self._order[self.index]])
            self.index += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation()


def deal_slots(probs: dict[str, float], credit: dict[str, float], n: int) -> dict[str, int]:
    """Deal ``n`` slots by deficit round-robin: each slot adds every domain's probability to its
    ``credit`` (updated in place) and goes to the domain with the most, which pays 1."""
    counts = dict.fromkeys(probs, 0)
    for _ in range(n):
        for d, p in probs.items():
            credit[d] += p
        d = max(credit, key=lambda k: (credit[k], k))
        credit[d] -= 1.0
        counts[d] += 1
    return counts


class DomainMixer:
    """Prompts from several domains in fixed shares (``data.domain_interleave_probs``).

    Each domain has its own :class:`PromptStream`. Slots are dealt by deficit round-robin: every slot
    adds each domain's probability to its credit and goes to the domain with the most credit, which
    then pays 1. The mix of every step is as close to the probabilities as whole prompts allow, and
    the long-run mix is exact (no sampling noise). The credits are part of the resumable state.
    """

    def __init__(self, rows: list[dict], probs: dict[str, float], seed: int):
        by_domain: dict[str, list[dict]] = {}
        for row in rows:
            by_domain.setdefault(row.get("domain", "default"), []).append(row)
        unknown = sorted(set(probs) - set(by_domain))
        if unknown:
            raise ConfigError(f"key 'data.domain_interleave_probs': no training row has domain "
                              f"{', '.join(map(repr, unknown))}; the data has {', '.join(sorted(by_domain))}")
        missing = sorted(set(by_domain) - set(probs))
        if missing:
            raise ConfigError(f"key 'data.domain_interleave_probs': the data also has domain(s) "
                              f"{', '.join(map(repr, missing))}; give each a probability (0 leaves it out)")
        self.probs = {d: p for d, p in sorted(probs.items()) if p > 0}
        self.streams = {d: PromptStream(by_domain[d], seed + 7919 * i) for i, d in enumerate(self.probs)}
        self.credit = {d: 0.0 for d in self.probs}

    @property
    def epoch(self) -> int:
        """Full passes over every domain (the smallest epoch of any domain)."""
        return min(s.epoch for s in self.streams.values())

    def next(self, n: int) -> list[dict]:
        counts = deal_slots(self.probs, self.credit, n)
        return [row for d, k in counts.items() if k for row in self.streams[d].next(k)]

    def next_from(self, domain: str, n: int) -> list[dict]:
        """``n`` prompts of one domain (for schedulers that keep a lane per domain)."""
        return self.streams[domain].next(n)

    def state(self) -> dict:
        return {"domains": {d: s.state() for d, s in self.streams.items()}, "credit": dict(self.credit)}

    def load_state(self, state: dict) -> None:
        for d, s in state["domains"].items():
            self.streams[d].load_state(s)
        self.credit = {d: float(c) for d, c in state["credit"].items()}


def dp_shards(batch: Batch, world: int, mini_batch_size: int | None = None) -> list[Batch]:
    """Each data-parallel rank's share of ``batch``: rank ``r`` gets the ``r``-th of ``world`` equal
    parts of every mini-batch of ``mini_batch_size`` rows (the whole batch when None), in order, so
    its ``k``-th local mini-batch is its part of the global ``k``-th one."""
    if world == 1:
        return [batch]
    minis = batch.split(mini_batch_size or len(batch))
    parts = [m.chunk(world) for m in minis]
    return [Batch.concat([p[r] for p in parts]) for r in range(world)]
