"""Environment-level asynchronous rollout: every environment runs its own episode loop.

In a synchronous batch rollout (:func:`roll_core.agentic.episodes.play`) every turn waits for the
slowest environment of the batch before the next generation starts; with heavy-tailed step latency
most environments idle most of the time. Here each environment slot runs :func:`play_one` in a
thread of its own: it asks for its next action, steps, and asks again, with no barrier between
environments. Requests from all slots meet in a :class:`RequestBatcher`, which sends whatever is
waiting as one batch to the policy the moment the previous batch returns (continuous batching at
the level of turns).

:class:`EnvLoops` keeps the slots busy across training steps. Episodes are handed out by group
(``group_size`` episodes of one seed); a step takes the first ``groups_per_step`` *complete* groups,
so a straggling group does not hold a step up. How far ahead of training the slots may play is
the async scheduler's bound, ``rollout.async_generation_ratio`` (``r``): at most ``(1 + r)`` steps'
worth of groups are out beyond those taken before the last policy update, so no group is older
than ``ceil(r)`` policy versions when taken; an older one (it straggled) is dropped, counted and
replaced. With ``r = 0`` the slots play only the current step's groups, starting after the weight
update (on-policy, like the sync rollout), and the step waits for all of them, but no turn waits
for another environment.

Weight updates go through :meth:`RequestBatcher.paused`: no generation runs while weights load.
"""

from __future__ import annotations

import math
import queue
import threading
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from roll_core.agentic.episodes import Policy, Rules, play_one
from roll_core.agentic.samples import Episode
from roll_core.envs import Env


class RequestBatcher:
    """One conversation per caller in, batched ``policy`` calls out: callers block in ``__call__``
    while a dispatcher thread sends every waiting request (up to ``max_batch``) as one call."""

    def __init__(self, policy: Policy, max_batch: int | None = None):
        self.policy, self.max_batch = policy, max_batch
        self.requests: queue.Queue = queue.Queue()
        self.lock = threading.Lock()  # held while a batch generates, and while paused
        self.calls = self.requests_served = 0
        self.closed = False
        self.thread = threading.Thread(target=self._dispatch, name="request-batcher", daemon=True)
        self.thread.start()

    def __call__(self, conversation: list[int], env: Env) -> tuple[list[int], list[float]]:
        future: Future = Future()
        self.requests.put((conversation, env, future))
        return future.result()

    def _dispatch(self) -> None:
        while True:
            first = self.requests.get()
            if first is None:
                return
            batch = [first]
            while self.max_batch is None or len(batch) < self.max_batch:
                try:
                    item = self.requests.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self.requests.put(None)  # stop after this batch
                    break
                batch.append(item)
            with self.lock:
                try:
                    replies = self.policy([c for c, _, _ in batch], [e for _, e, _ in batch])
                except BaseException as exc:  # noqa: BLE001 - every waiting caller sees it
                    for _, _, future in batch:
                        future.set_exception(exc)
                    continue
                self.calls += 1
                self.requests_served += len(batch)
            for (_, _, future), reply in zip(batch, replies):
                future.set_result(reply)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No policy call runs inside (the running one finishes first): for weight updates."""
        with self.lock:
            yield

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.requests.put(None)
            self.thread.join(timeout=60)


@dataclass
class _Group:
    group: int
    seed: int
    version: int  # the policy version when it was handed out
    episodes: list[Episode]


class EnvLoops:
    """Environment-level asynchronous rollout over ``envs`` (slots: local or
    :class:`~roll_core.agentic.env_workers.RemoteEnv`); see the module docstring.

    ``seed_of(group)`` is the seed of group ``group`` (0, 1, ...). :meth:`take` returns the next
    step's groups; the pipeline bumps :attr:`version` after each weight update."""

    def __init__(self, envs: Sequence[Env], ask: RequestBatcher, rules: Rules, *, groups_per_step: int,
                 group_size: int, seed_of: Callable[[int], int], async_generation_ratio: float = 0.0):
        self.envs, self.ask, self.rules = envs, ask, rules
        self.groups_per_step, self.group_size, self.seed_of = groups_per_step, group_size, seed_of
        self.max_staleness = math.ceil(async_generation_ratio)
        self.version = 0
        self.cond = threading.Condition()
        self.next_episode = 0  # episode k belongs to group k // group_size
        # groups that may be handed out: one batch plus the run-ahead at first, then, at each policy
        # update, as many as were taken since the last one, and one more for each group dropped
        self.released = math.ceil((1 + async_generation_ratio) * groups_per_step)
        self.taken_since_update = 0
        self.open: dict[int, _Group] = {}
        self.complete: list[_Group] = []
        self.dropped = 0  # groups too stale when complete
        self.stopping = False
        self.threads = [threading.Thread(target=self._loop, args=(env,), name=f"env-loop-{i}", daemon=True)
                        for i, env in enumerate(envs)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _admitted(self) -> bool:
        """Whether the next episode's group may be handed out (the run-ahead bound)."""
        return self.next_episode // self.group_size < self.released

    def policy_updated(self) -> None:
        """The policy's weights changed (after the pipeline pushed them): one more version, and the
        groups taken since the last update are replaced by new ones."""
        with self.cond:
            self.version += 1
            self.released += self.taken_since_update
            self.taken_since_update = 0
            self.cond.notify_all()

    def _next(self) -> tuple[_Group, int] | None:
        with self.cond:
            while not self.stopping and not self._admitted():
                self.cond.wait()
            if self.stopping:
                return None
            g = self.next_episode // self.group_size
            if g not in self.open:
                self.open[g] = _Group(g, self.seed_of(g), self.version, [])
            self.next_episode += 1
            return self.open[g], self.seed_of(g)

    def _loop(self, env: Env) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            group, seed = job
            episode = play_one(env, seed, group.group, self.ask, self.rules)
            with self.cond:
                group.episodes.append(episode)
                if len(group.episodes) == self.group_size:
                    del self.open[group.group]
                    self.complete.append(group)
                    self.cond.notify_all()

    def take(self) -> tuple[list[Episode], dict[str, float]]:
        """The first ``groups_per_step`` complete groups no staler than ``ceil(r)`` versions (blocks
        until there are), their episodes in group order, and the rollout's metrics."""
        taken: list[_Group] = []
        with self.cond:
            while len(taken) < self.groups_per_step:
                while not self.complete:
                    self.cond.wait()
                group = self.complete.pop(0)
                if self.version - group.version > self.max_staleness:
                    self.dropped += 1
                    self.released += 1
                    self.cond.notify_all()
                    continue
                taken.append(group)
            self.taken_since_update += len(taken)
        staleness = [self.version - g.version for g in taken]
        metrics = {"rollout/staleness_mean": sum(staleness) / len(staleness),
                   "rollout/stale_groups_dropped": float(self.dropped),
                   "rollout/requests_per_call": self.ask.requests_served / max(self.ask.calls, 1)}
        taken.sort(key=lambda g: g.group)
        return [e for g in taken for e in g.episodes], metrics

    def stop(self) -> None:
        """Hand out nothing more; episodes in progress finish and are discarded."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
