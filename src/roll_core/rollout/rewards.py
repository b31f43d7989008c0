"""Reward routing: every sample goes to the reward workers of its domain.

Multi-domain RLVR (math, code, instructions, ... in one run) gives each domain its own reward
worker group (``roles.domain_rewards``); every other sample goes to the default group
(``roles.reward``). Schedulers :meth:`RewardRouter.submit` samples as soon as their generation
request finishes and :meth:`RewardRouter.gather` the scores at the end, so scoring runs on its own
workers while generation goes on. A group of lightweight rewards may live in the driver instead
(``placement``): every call goes through the group's own executor, so the two kinds mix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roll_core.data import even_slices
from roll_core.rewards import RewardInput
from roll_core.runtime.executor import WorkerGroup


@dataclass
class RewardTicket:
    """Pending scores of one submission: ``(future, group, worker index, worker handle, row indices)``
    per worker call."""

    size: int
    parts: list[tuple[object, WorkerGroup, int, object, list[int]]] = field(default_factory=list)

    def futures(self) -> list:
        return [future for future, *_ in self.parts]


class RewardRouter:
    def __init__(self, default: WorkerGroup, by_domain: dict[str, WorkerGroup] | None = None):
        self.default = default
        self.by_domain = dict(by_domain or {})
        self._cursor: dict[str, int] = {}
        self.failures = {"reward/timeouts": 0.0, "reward/nonfinite": 0.0, "reward/replaced_workers": 0.0}
        # A worker replaced after a hung call keeps serving the calls already queued on it, and is
        # stopped once the last of them is gathered (killing it at once would fail them all).
        self._pending: dict[int, int] = {}  # id(handle) -> calls submitted and not yet gathered
        self._retiring: dict[int, tuple] = {}  # id(handle) -> (its executor, a replaced worker's handle)

    def group_of(self, domain: str) -> WorkerGroup:
        return self.by_domain.get(domain, self.default)

    def groups(self) -> list[WorkerGroup]:
        return [self.default, *self.by_domain.values()]

    def submit(self, samples: list[RewardInput]) -> RewardTicket:
        """Start scoring ``samples``; a domain's samples are spread over its workers round-robin."""
        ticket = RewardTicket(len(samples))
        by_group: dict[str, tuple[WorkerGroup, list[int]]] = {}
        for i, s in enumerate(samples):
            group = self.group_of(s.domain)
            by_group.setdefault(group.role, (group, []))[1].append(i)
        for role, (group, rows) in by_group.items():
            for piece in even_slices(len(rows), min(len(group), len(rows))):
                part = rows[piece]
                w = self._cursor.get(role, 0)
                self._cursor[role] = (w + 1) % len(group)
                handle = group.handles[w]
                future = group.executor.invoke(handle, "score_detailed", ([samples[i] for i in part],), {})
                ticket.parts.append((future, group, w, handle, part))
                self._pending[id(handle)] = self._pending.get(id(handle), 0) + 1
        return ticket

    def ready(self) -> None:
        """Raises a reward constructor's error (one line naming the reward and its plugin), if any."""
        for group in self.groups():
            group.executor.get(group.call("ready"))

    def pop_failures(self) -> dict[str, float]:
        """Timeouts, non-finite scores, replaced workers and the rewards' own counters
        (``reward/<name>/<key>``, :meth:`~roll_core.rewards.Reward.metrics`) since the last call
        (step metrics)."""
        out, self.failures = self.failures, dict.fromkeys(self.failures, 0.0)
        return out

    def gather(self, ticket: RewardTicket) -> tuple[list[float], list[dict[str, float]], float]:
        """Scores in submission order, each sample's per-reward components, and worker seconds."""
        scores: list[float] = [0.0] * ticket.size
        components: list[dict[str, float]] = [{} for _ in range(ticket.size)]
        seconds = 0.0
        for future, group, worker, handle, rows in ticket.parts:
            result = group.executor.get(future)
            self._pending[id(handle)] -= 1
            seconds += result["seconds"]
            # every key of RewardWorker.score_detailed's result is always there
            self.failures["reward/timeouts"] += result["timeouts"]
            self.failures["reward/nonfinite"] += result["nonfinite"]
            for key, n in result["counters"].items():
                self.failures[f"reward/{key}"] = self.failures.get(f"reward/{key}", 0.0) + n
            if result["replace"] and group.handles[worker] is handle:  # a call hung on it: a fresh worker
                self._retiring[id(handle)] = (group.executor, group.executor.replace(group, worker))
                group.executor.get(group.executor.invoke(group.handles[worker], "ready", (), {}))
                self.failures["reward/replaced_workers"] += 1
            for j, i in enumerate(rows):
                scores[i] = result["scores"][j]
                components[i] = {name: values[j] for name, values in result["components"].items()}
        for key in [k for k in self._retiring if not self._pending.get(k)]:
            executor, retired = self._retiring.pop(key)
            executor.stop(retired)
            self._pending.pop(key, None)
        return scores, components, seconds
