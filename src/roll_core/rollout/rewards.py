"""Reward routing: every sample goes to the reward workers of its domain.

Multi-domain RLVR (math, code, instructions, ... in one run) gives each domain its own reward
worker group (``roles.domain_rewards``); every other sample goes to the default group
(``roles.reward``). Schedulers :meth:`RewardRouter.submit` samples as soon as their generation
request finishes and :meth:`RewardRouter.gather` the scores at the end, so scoring runs on its own
workers while generation goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roll_core.data import even_slices
from roll_core.rewards import RewardInput
from roll_core.runtime.executor import Executor, WorkerGroup


@dataclass
class RewardTicket:
    """Pending scores of one submission: ``(future, row indices)`` per worker call."""

    size: int
    parts: list[tuple[object, list[int]]] = field(default_factory=list)


class RewardRouter:
    def __init__(self, executor: Executor, default: WorkerGroup, by_domain: dict[str, WorkerGroup] | None = None):
        self.executor, self.default = executor, default
        self.by_domain = dict(by_domain or {})
        self._cursor: dict[str, int] = {}

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
                future = self.executor.invoke(group.handles[w], "score_detailed", ([samples[i] for i in part],), {})
                ticket.parts.append((future, part))
        return ticket

    def gather(self, ticket: RewardTicket) -> tuple[list[float], list[dict[str, float]], float]:
        """Scores in submission order, each sample's per-reward components, and worker seconds."""
        scores: list[float] = [0.0] * ticket.size
        components: list[dict[str, float]] = [{} for _ in range(ticket.size)]
        seconds = 0.0
        results = self.executor.get([f for f, _ in ticket.parts])
        for (_, rows), result in zip(ticket.parts, results):
            seconds += result["seconds"]
            for j, i in enumerate(rows):
                scores[i] = result["scores"][j]
                components[i] = {name: values[j] for name, values in result["components"].items()}
        return scores, components, seconds
