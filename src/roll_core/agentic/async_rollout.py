"""Environment-level asynchronous rollout: every environment runs its own episode loop.

In a synchronous batch rollout (:func:`roll_core.agentic.episodes.play`) every turn waits for the
slowest environment of the batch before the next generation starts; with heavy-tailed step latency
most environments idle most of the time. Here each environment slot runs :func:`play_one` in a
thread of its own: it asks for its next action, steps, and asks again, with no barrier between
environments. Requests from all slots meet in a :class:`RequestBatcher`, which sends whatever is
waiting as one batch to the policy the moment the previous batch returns (continuous batching at
the level of turns).

:class:`EnvLoops` keeps the slots busy across training steps. Episodes are handed out by group
(``group_size`` episodes of one seed); a step takes the first ``groups_per_step`` *complete* groups
of each environment of the run (a :class:`Lane` each, with its own slots and counts), so a
straggling group does not hold a step up. How far ahead of training the slots may play is
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

from roll_core.agentic.episodes import Policy, Rules, images_keyword, play_one
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

    def __call__(self, conversation: list[int], env: Env, images=None) -> tuple[list[int], list[float]]:
        future: Future = Future()
        self.requests.put((conversation, env, images, future))
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
                    replies = self.policy([c for c, _, _, _ in batch], [e for _, e, _, _ in batch],
                                          **images_keyword([i for _, _, i, _ in batch]))
                except BaseException as exc:  # noqa: BLE001 - every waiting caller sees it
                    for _, _, _, future in batch:
                        future.set_exception(exc)
                    continue
                self.calls += 1
                self.requests_served += len(batch)
            for (_, _, _, future), reply in zip(batch, replies):
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


@dataclass(frozen=True)
class Lane:
    """One environment of the run for :class:`EnvLoops`: its slots (local or
    :class:`~roll_core.agentic.env_workers.RemoteEnv`), how its turns are written and cut, how many
    of its groups a step takes, and the seed of its group ``g`` (0, 1, ...). ``label`` names its
    episodes (``Episode.env``)."""

    label: str
    envs: Sequence[Env]
    rules: Rules
    groups_per_step: int
    seed_of: Callable[[int], int]


@dataclass
class _Group:
    group: int
    seed: int
    version: int  # the policy version when it was handed out
    episodes: list[Episode]


class _LaneState:
    """What :class:`EnvLoops` counts for one lane (all under its condition variable)."""

    def __init__(self, lane: Lane, released: int):
        self.lane = lane
        self.next_episode = 0  # episode k belongs to group k // group_size
        # groups that may be handed out: one batch plus the run-ahead at first, then, at each policy
        # update, as many as were taken since the last one, and one more for each group dropped
        self.released = released
        self.taken_since_update = 0
        self.open: dict[int, _Group] = {}
        self.complete: list[_Group] = []


class EnvLoops:
    """Environment-level asynchronous rollout over the slots of every lane (one lane per
    environment of the run); see the module docstring. :meth:`take` returns the next step's groups
    of every lane; the pipeline calls :meth:`policy_updated` after each weight update."""

    def __init__(self, lanes: Sequence[Lane], ask: RequestBatcher, *, group_size: int,
                 async_generation_ratio: float = 0.0):
        self.ask, self.group_size = ask, group_size
        self.max_staleness = math.ceil(async_generation_ratio)
        self.version = 0
        self.cond = threading.Condition()
        self.lanes = [_LaneState(lane, math.ceil((1 + async_generation_ratio) * lane.groups_per_step))
                      for lane in lanes]
        self.dropped = 0  # groups too stale when complete
        self.stopping = False
        self.threads = [threading.Thread(target=self._loop, args=(state, env), name=f"env-loop-{state.lane.label}-{i}",
                                         daemon=True)
                        for state in self.lanes for i, env in enumerate(state.lane.envs)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _admitted(self, state: _LaneState) -> bool:
        """Whether the lane's next episode's group may be handed out (the run-ahead bound)."""
        return state.next_episode // self.group_size < state.released

    def policy_updated(self) -> None:
        """The policy's weights changed (after the pipeline pushed them): one more version, and the
        groups taken since the last update are replaced by new ones."""
        with self.cond:
            self.version += 1
            for state in self.lanes:
                state.released += state.taken_since_update
                state.taken_since_update = 0
            self.cond.notify_all()

    def _next(self, state: _LaneState) -> _Group | None:
        with self.cond:
            while not self.stopping and not self._admitted(state):
                self.cond.wait()
            if self.stopping:
                return None
            g = state.next_episode // self.group_size
            if g not in state.open:
                state.open[g] = _Group(g, state.lane.seed_of(g), self.version, [])
            state.next_episode += 1
            return state.open[g]

    def _loop(self, state: _LaneState, env: Env) -> None:
        lane = state.lane
        while True:
            group = self._next(state)
            if group is None:
                return
            episode = play_one(env, group.seed, group.group, self.ask, lane.rules, label=lane.label)
            with self.cond:
                group.episodes.append(episode)
                if len(group.episodes) == self.group_size:
                    del state.open[group.group]
                    state.complete.append(group)
                    self.cond.notify_all()

    def _take_lane(self, state: _LaneState) -> list[_Group]:
        """The lane's first ``groups_per_step`` complete groups no staler than ``ceil(r)`` versions
        (under the condition variable; waits until there are)."""
        taken: list[_Group] = []
        while len(taken) < state.lane.groups_per_step:
            while not state.complete:
                self.cond.wait()
            group = state.complete.pop(0)
            if self.version - group.version > self.max_staleness:
                self.dropped += 1
                state.released += 1
                self.cond.notify_all()
                continue
            taken.append(group)
        state.taken_since_update += len(taken)
        return sorted(taken, key=lambda g: g.group)

    def take(self) -> tuple[list[Episode], dict[str, float]]:
        """The next step's groups, lane by lane (blocks until each lane has its ``groups_per_step``
        complete groups), their episodes in group order, and the rollout's metrics."""
        with self.cond:
            taken = [g for state in self.lanes for g in self._take_lane(state)]
        staleness = [self.version - g.version for g in taken]
        metrics = {"rollout/staleness_mean": sum(staleness) / len(staleness),
                   "rollout/stale_groups_dropped": float(self.dropped),
                   "rollout/requests_per_call": self.ask.requests_served / max(self.ask.calls, 1)}
        return [e for g in taken for e in g.episodes], metrics

    def stop(self) -> None:
        """Hand out nothing more; episodes in progress finish and are discarded."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
