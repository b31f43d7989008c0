"""``async``: rollout that never stops for training, with bounded staleness (after ROLL Flash).

The synchronous loop leaves the inference workers idle while the policy trains and the trainer idle
while the slowest sample of the step finishes. This scheduler keeps a queue of generation requests
(``rollout.request_size`` samples each) on every inference worker, at most
``rollout.max_running_requests`` each, and drives them from the controller's event loop:

* a finished request is scored at once on the reward workers of its samples' domains;
* a group whose scores are in passes the dynamic-sampling filter or is dropped (counted);
* ``next_batch`` hands the trainer the first ``prompts_per_step`` complete groups, oldest first;
* while the trainer works (``wait``), the loop keeps generating and scoring.

Staleness. ``version`` counts the weight updates the inference workers have received. A group
generated at version ``v`` and trained on at step ``s`` (whose weights are version ``s - 1``) has
staleness ``s - 1 - v``. ``rollout.async_generation_ratio`` = ``r`` bounds it: a group is only
started if, counting the groups queued before it, it would be trained on within ``ceil(r)`` steps,
and at most ``r * prompts_per_step`` groups are generated ahead of the step being trained. A group
that is staler than ``ceil(r)`` when its turn comes is dropped and counted, never trained on: with
``r >= 1`` a slow group can be overtaken by groups started after it (long-tailed generation) until it
is too old, and redundant prompts leave groups waiting. ``r = 0`` is synchronous training on the same
machinery: nothing starts before the weights of the previous step arrive.

Redundant prompts (``rollout.max_additional_running_prompts``) keep extra groups in flight so that a
batch fills without waiting for stragglers or for groups the filter rejects; groups left over when
a batch is full stay queued for the next step if they can still be fresh enough for it. Those that
cannot (with ``r = 0`` every leftover) are aborted at once: samples not yet sent are forgotten, their
requests are cancelled (``Executor.cancel``; a running ``hf`` generation stops at its next token,
see :func:`roll_core.strategy.request_cancelled`) and results already on the way are discarded.

Sample-level requests. A group is admitted as a whole (the staleness bound counts groups) but
becomes ``num_return_sequences`` independent samples, sent ``rollout.request_size`` at a time:
``request_size = 1`` makes every sample its own request, scored the moment it finishes; a multiple
of the group size sends whole groups. A group is complete, and filtered, when its last sample is
scored; its version is the oldest weights any of its samples was generated with.

Ordering. Weight updates go to each inference worker as an ordinary call, queued behind the requests
already sent to it (a worker runs its calls in order), so every request is generated entirely with
the weights of the version it was tagged with. The ``infer_log_probs`` of the sampler are kept in
the batch for off-policy corrections (``policy_loss: tis``).

Request size is a trade-off for engines that decode a batch in one pass (``hf``): one request per
sample multiplies the number of forward passes. Engines with continuous batching (vLLM, SGLang)
declare ``concurrent_requests`` and get workers that run ``max_running_requests`` requests at once,
so a short sample returns while a long one still decodes (``benchmarks/bench_long_tail.py``
measures this with long-tailed lengths).

The parts: :class:`StalenessBudget` (admission and the staleness bound), :class:`DomainLanes` (each
domain's quota of a batch), :class:`InFlight` (every future the scheduler waits on, with the
callback that handles it) and the scheduler, which admits groups, files results and hands out batches.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch

from roll_core.algorithms.shaping import outcome_token_rewards
from roll_core.data import Batch, deal_slots
from roll_core.errors import RollError
from roll_core.rollout.rewards import RewardTicket
from roll_core.rollout.sync import SyncRolloutScheduler, expand_rows


@dataclass
class _Request:
    future: object
    worker: int
    samples: list[tuple[int, int]]  # (group, index within the group) per row


@dataclass
class _Scoring:
    """A finished request being scored."""

    ticket: RewardTicket
    part: Batch
    samples: list[tuple[int, int]]
    done: set[int] = field(default_factory=set)

    def futures(self) -> list:
        return self.ticket.futures()


@dataclass
class _Group:
    """A group admitted and not yet complete: its samples are pending, generating or scoring."""

    row: dict
    version: int | None = None  # oldest weights any of its samples was sent to be generated with
    pieces: list[tuple[list[int], Batch]] = field(default_factory=list)  # scored (indices, rows)
    scored: int = 0


class InFlight:
    """The futures the scheduler waits on, each with the callback that handles it.

    One ``wait`` covers every kind of work at once (generation, cancelled requests, reward scoring,
    reference log-probs, plus futures the caller passes in, such as a training step). Callbacks run
    by ``phase`` and then in the order their futures were added (a generation result before the
    scores it leads to, scores before reference log-probs), so the order of events is deterministic."""

    def __init__(self, executor):
        self.executor = executor
        self._entries: list[tuple[int, int, object, Callable[[object], None]]] = []  # (phase, seq, future, cb)
        self._seq = 0
        self.wait_s = 0.0  # seconds spent blocked in the executor's wait

    def add(self, future, callback: Callable[[object], None], phase: int) -> None:
        self._entries.append((phase, self._seq, future, callback))
        self._seq += 1

    def redirect(self, future, callback: Callable[[object], None], phase: int) -> None:
        """Handle ``future`` with ``callback`` from now on (a request that was cancelled)."""
        self._entries = [(phase, seq, f, callback) if f is future else (p, seq, f, cb)
                         for p, seq, f, cb in self._entries]

    def __bool__(self) -> bool:
        return bool(self._entries)

    def wait(self, extra: list) -> list[int] | None:
        """Block until at least one future (or one of ``extra``) finishes and run the callbacks of the
        finished ones. Returns the positions in ``extra`` that finished, or None when nothing was
        in flight and ``extra`` is empty."""
        entries = sorted(self._entries, key=lambda e: (e[0], e[1]))
        waiting = [f for _, _, f, _ in entries] + list(extra)
        if not waiting:
            return None
        t0 = time.perf_counter()
        ready = set(self.executor.wait(waiting))
        self.wait_s += time.perf_counter() - t0
        done = [entries[k] for k in sorted(ready) if k < len(entries)]
        finished = {id(e[2]) for e in done}
        self._entries = [e for e in self._entries if id(e[2]) not in finished]
        for _, _, future, callback in done:
            callback(future)
        return [k - len(entries) for k in sorted(ready) if k >= len(entries)]


# callback phases of InFlight: what a finished generation frees comes first, references last
_GENERATED, _SCORED, _REFERENCED = 0, 1, 2


@dataclass
class StalenessBudget:
    """Which groups may start, and which may still be trained on (see the module docstring).

    ``version`` counts the weight updates sent to the inference workers, ``steps_started`` the
    batches handed to the trainer; a group generated at version ``v`` and trained at step ``s`` has
    staleness ``s - 1 - v``, bounded by ``max_stale = ceil(ratio)``."""

    ratio: float
    want: int  # groups per batch
    extra: int  # redundant groups allowed in flight
    version: int = 0
    steps_started: int = 0

    @property
    def max_stale(self) -> int:
        return math.ceil(self.ratio)

    @staticmethod
    def staleness(version: int, step: int) -> int:
        """Updates between a group's weights (``version``) and those trained at ``step`` (``step - 1``)."""
        return step - 1 - version

    def too_stale(self, version: int, step: int) -> bool:
        return self.staleness(version, step) > self.max_stale

    def admissible(self, outstanding: int) -> int:
        """How many more groups may start now without breaking the bound.

        A group started now is trained on after everything outstanding, i.e. at step
        ``steps_started + 1 + outstanding // want``; its staleness is that minus 1 minus ``version``.
        The bound: at most ``(1 + ratio + version - steps_started) * want`` outstanding groups."""
        limit = math.floor((1 + self.ratio + self.version - self.steps_started) * self.want + 1e-9)
        # Redundant prompts only pad a batch that may be generated now, never one further ahead.
        return max(0, limit + (self.extra if limit > 0 else 0) - outstanding)


class DomainLanes:
    """Per-domain lanes (multi-domain RLVR): every batch holds each domain's share.

    The quota of a step is ``domain_interleave_probs`` dealt over ``prompts_per_step`` slots by
    deficit round-robin, step after step (as the sync path mixes)."""

    def __init__(self, probs: dict[str, float], want: int):
        self.probs, self.want = dict(probs), want
        self._credit = dict.fromkeys(self.probs, 0.0)
        self._quotas: list[dict[str, int]] = []

    def quota(self, step: int) -> dict[str, int]:
        """Groups of each domain in the batch of ``step``."""
        while len(self._quotas) < step:
            self._quotas.append(deal_slots(self.probs, self._credit, self.want))
        return self._quotas[step - 1]

    def neediest(self, first_step: int, steps: int, extra: int, outstanding: Counter) -> str:
        """The domain furthest below what the batches of ``steps`` steps from ``first_step`` need
        (their quotas, plus its share of the ``extra`` redundant groups), given its ``outstanding``
        groups. A domain whose groups are slower or filtered more keeps more of them in flight, and
        one that runs ahead waits."""
        target: Counter[str] = Counter()
        for step in range(first_step, first_step + steps):
            target.update(self.quota(step))

        def deficit(d):
            return target[d] + math.ceil(extra * self.probs[d]) - outstanding[d], self.probs[d], d
        return max(self.probs, key=deficit)

    def fits(self, group: Batch, chosen: list, step: int) -> bool:
        """Whether ``group`` may join the batch of ``step`` (its domain's quota is not full yet)."""
        domain = group["domain"][0]
        return sum(b["domain"][0] == domain for _, b in chosen) < self.quota(step).get(domain, 0)


class AsyncRolloutScheduler(SyncRolloutScheduler):
    """Registered with ``overlaps_training=True``: it generates while the trainer works."""

    def __init__(self, config, executor, infer_group, reward_router, tokenizer):
        super().__init__(config, executor, infer_group, reward_router, tokenizer)
        r = config.rollout
        self.budget = StalenessBudget(r.async_generation_ratio, r.prompts_per_step, r.max_additional_running_prompts)
        self.want = r.prompts_per_step
        self.group_size = r.num_return_sequences
        self.request_size = r.request_size or r.num_return_sequences
        self.max_running = r.max_running_requests
        self.domain_lanes: DomainLanes | None = None  # set by start() for a multi-domain stream
        self.next_group = 0
        self.open: dict[int, _Group] = {}  # admitted groups not complete yet
        self.pending: list[tuple[int, int]] = []  # samples of admitted groups not sent to a worker yet
        self.inflight = InFlight(executor)
        self.requests: list[_Request] = []  # generating
        self.aborting: list[_Request] = []  # cancelled, until their workers are free again
        self.referencing: list[list[tuple[int, Batch]]] = []  # (version, group)s whose reference call runs
        self._to_reference: list[tuple[int, Batch]] = []
        self.ready: list[tuple[int, Batch]] = []  # (version, one scored, kept group), completion order
        self.chosen: list[tuple[int, Batch]] = []  # the batch being assembled (still outstanding)
        self.rejected: list[tuple[int, Batch]] = []  # filtered out this step (only a fallback uses them)
        self._cursor = 0
        self.accepting = True
        self._idle_since: dict[int, float] = {w: time.perf_counter() for w in range(len(self.infer))}
        self._reset_step_stats()

    # ------------------------------------------------------------------------------------------
    # admission: which groups may start now
    # ------------------------------------------------------------------------------------------
    def outstanding(self) -> int:
        """Groups started and neither trained on nor dropped yet."""
        return (len(self.open) + sum(len(groups) for groups in self.referencing) + len(self.ready)
                + len(self.chosen))

    def admissible(self) -> int:
        """How many more groups may start now (:meth:`StalenessBudget.admissible`); none once stopping."""
        return self.budget.admissible(self.outstanding()) if self.accepting else 0

    def _admit(self, n: int) -> None:
        """Start ``n`` more groups: each becomes ``group_size`` pending samples."""
        rows = iter(self.stream.next(n)) if self.domain_lanes is None else None
        for _ in range(n):
            # With lanes, one at a time: each choice must see the groups admitted just before it.
            row = next(rows) if rows is not None else self._lane_row()
            g = self.next_group
            self.next_group += 1
            self.open[g] = _Group(row)
            self.pending += [(g, j) for j in range(self.group_size)]

    # ------------------------------------------------------------------------------------------
    # per-domain lanes (multi-domain RLVR): every batch holds each domain's share
    # ------------------------------------------------------------------------------------------
    @property
    def lanes(self) -> dict[str, float] | None:
        """Each domain's share of a batch, or None for a single-domain stream."""
        return self.domain_lanes.probs if self.domain_lanes is not None else None

    def quota(self, step: int) -> dict[str, int]:
        """Groups of each domain in the batch of ``step`` (:meth:`DomainLanes.quota`)."""
        assert self.domain_lanes is not None
        return self.domain_lanes.quota(step)

    def _domain_counts(self) -> Counter:
        """Outstanding groups per domain."""
        counts = Counter(g.row.get("domain", "default") for g in self.open.values())
        counts.update(batch["domain"][0] for groups in self.referencing for _, batch in groups)
        counts.update(batch["domain"][0] for _, batch in self.ready + self.chosen)
        return counts

    def _lane_row(self) -> dict:
        """A prompt from the domain that the batches generation may now run ahead for need most."""
        assert self.domain_lanes is not None
        domain = self.domain_lanes.neediest(self.budget.steps_started + 1, self.budget.max_stale + 1,
                                            self.budget.extra, self._domain_counts())
        return self.stream.next_from(domain, 1)[0]

    def _fits(self, group: Batch, chosen: list, step: int) -> bool:
        return self.domain_lanes is None or self.domain_lanes.fits(group, chosen, step)

    def _top_up(self) -> None:
        """Send ``request_size`` pending samples to every worker below ``max_running_requests``,
        admitting groups as the staleness bound allows."""
        running = Counter(q.worker for q in self.requests + self.aborting)
        budget = self.admissible()
        while True:
            worker = min(range(len(self.infer)), key=lambda w: (running[w], (w - self._cursor) % len(self.infer)))
            if running[worker] >= self.max_running:
                return
            if len(self.pending) < self.request_size and budget > 0:
                n = min(budget, math.ceil((self.request_size - len(self.pending)) / self.group_size))
                self._admit(n)
                budget -= n
            if not self.pending:
                return
            samples, self.pending = self.pending[: self.request_size], self.pending[self.request_size:]
            batch = expand_rows(self.tokenizer, [self.open[g].row for g, _ in samples], 1)
            batch.update(group_index=torch.tensor([g for g, _ in samples]))
            future = self.executor.invoke(self.infer.handles[worker], "generate", (batch,),
                                          self._sampling(self.config.rollout.temperature))
            request = _Request(future, worker, samples)
            self.requests.append(request)
            self.inflight.add(future, lambda _, q=request: self._generated(q), _GENERATED)
            self.stats["rollout/requests"] += 1
            version = self.budget.version
            for g in {g for g, _ in samples}:
                group = self.open[g]
                group.version = version if group.version is None else min(group.version, version)
            self._mark_busy(worker)
            self._cursor = (worker + 1) % len(self.infer)
            running[worker] += 1

    # ------------------------------------------------------------------------------------------
    # the event loop
    # ------------------------------------------------------------------------------------------
    def _pump(self, extra_futures: list) -> list[int] | None:
        """Start what may start, wait for at least one event, handle it. Returns the positions in
        ``extra_futures`` that finished, or None when there was nothing to wait for."""
        self._top_up()
        waited = self.inflight.wait_s
        finished = self.inflight.wait(extra_futures)
        if finished is None:
            return None
        self.stats["time/driver_wait_s"] += self.inflight.wait_s - waited
        self._top_up()
        return finished

    # -- what a finished future does (InFlight callbacks) ---------------------------------------
    def _generated(self, q: _Request) -> None:
        """A request's samples are in: score them on the reward workers of their domains."""
        self.requests = [r for r in self.requests if r is not q]  # by identity: results are not comparable
        self._note_if_idle(q.worker)
        part, samples = self._finish_request(self.executor.get(q.future))
        scoring = _Scoring(self.reward.submit(samples), part, q.samples)
        for k, future in enumerate(scoring.futures()):
            self.inflight.add(future, lambda _, s=scoring, k=k: self._scored(s, k), _SCORED)

    def _aborted(self, q: _Request) -> None:
        """A cancelled request is never fetched (Ray raises for it); its worker is free again."""
        self.aborting = [r for r in self.aborting if r is not q]
        self._note_if_idle(q.worker)

    def _scored(self, s: _Scoring, part: int) -> None:
        s.done.add(part)
        if len(s.done) == len(s.futures()):
            self._complete(s)

    def _referenced(self, future, groups: list[tuple[int, Batch]]) -> None:
        self.referencing = [g for g in self.referencing if g is not groups]
        ref, start = self.executor.get(future), 0
        for version, rows in groups:
            width = rows["responses"].shape[1]
            self.ready.append((version, rows.update(ref_log_probs=ref[start:start + len(rows), :width])))
            start += len(rows)

    def _note_if_idle(self, worker: int) -> None:
        if not any(r.worker == worker for r in self.requests + self.aborting):
            self._idle_since.setdefault(worker, time.perf_counter())

    def _complete(self, s: _Scoring) -> None:
        """Scores of one request are in: file each sample under its group; a group whose samples
        are all scored passes the dynamic-sampling filter into ``ready`` or is rejected."""
        scores, components, seconds = self.reward.gather(s.ticket)
        self.stats["time/reward_s"] += seconds
        scores_t = torch.tensor(scores, dtype=torch.float32)
        part = s.part.update(scores=scores_t, reward_components=components,
                             token_level_rewards=outcome_token_rewards(scores_t, s.part["response_mask"]))
        self._scores.append(scores_t)
        rows_of: dict[int, list[int]] = {}
        for k, (g, _) in enumerate(s.samples):
            rows_of.setdefault(g, []).append(k)
        for g, rows in rows_of.items():
            group = self.open.get(g)
            if group is None:  # aborted while this request was generating or scoring
                continue
            group.pieces.append(([s.samples[k][1] for k in rows], part.select(rows)))
            group.scored += len(rows)
            if group.scored == self.group_size:
                del self.open[g]
                self._file(group)
        self._submit_reference()

    def _submit_reference(self) -> None:
        """One reference call for the kept groups that completed together (the whole request's
        when it held whole groups, one group when its samples were requested one by one)."""
        groups, self._to_reference = self._to_reference, []
        if not groups:
            return
        replica = self._ref_cursor % self.reference.dp_size  # a sharded reference: all its workers
        self._ref_cursor += 1
        future = self.reference.on_replica(replica, "compute_log_probs", Batch.concat([b for _, b in groups]),
                                           temperature=self.config.rollout.temperature)
        self.referencing.append(groups)
        self.inflight.add(future, lambda f, groups=groups: self._referenced(f, groups), _REFERENCED)

    def _file(self, group: _Group) -> None:
        index = [j for js, _ in group.pieces for j in js]
        assert group.version is not None  # set when its first sample was sent
        rows = Batch.concat([piece for _, piece in group.pieces])
        rows = rows.select(sorted(range(len(index)), key=index.__getitem__))  # sample order, whatever finished first
        if bool(self.sampling.keep(rows["scores"], rows["group_index"]).all()):
            # With a streamed reference, its log-probs first (see _submit_reference).
            (self._to_reference if self.reference is not None else self.ready).append((group.version, rows))
        else:
            self.rejected.append((group.version, rows))

    def _abort_hopeless(self, step: int) -> None:
        """After the batch of ``step`` is handed out, abort the groups that would be too stale for
        any later step (their oldest sample's weights are more than ``ceil(ratio)`` updates behind
        those of step ``step + 1``): their pending samples are never sent, their requests are
        cancelled, and results still on the way are discarded. Groups only queued (not yet sent)
        stay: they will be generated with newer weights."""
        def hopeless(version):
            return version is not None and self.budget.too_stale(version, step + 1)

        lost = {g for g, group in self.open.items() if hopeless(group.version)}
        if not lost:
            return
        for g in lost:
            del self.open[g]
        self.stats["rollout/aborted_groups"] += len(lost)
        self.pending = [(g, j) for g, j in self.pending if g not in lost]
        cancel = [q for q in self.requests if all(g in lost for g, _ in q.samples)]
        self._cancel(cancel)

    def _cancel(self, requests: list[_Request]) -> None:
        if not requests:
            return
        self.executor.cancel([q.future for q in requests])
        self.stats["rollout/aborted_requests"] += len(requests)
        gone = {id(q) for q in requests}
        self.requests = [q for q in self.requests if id(q) not in gone]
        self.aborting += requests
        for q in requests:
            self.inflight.redirect(q.future, lambda _, q=q: self._aborted(q), _GENERATED)

    # ------------------------------------------------------------------------------------------
    # what the pipeline calls
    # ------------------------------------------------------------------------------------------
    def start(self, stream, reference=None) -> None:
        """Draw prompts from ``stream``. With ``reference`` (the reference role's worker group, when
        it has devices of its own), every group that passes the filter gets its ``ref_log_probs``
        there before it is ready, in parallel with generation and scoring: the reference model
        never changes, so they need not wait for the trainer, and the pipeline skips that forward
        pass on the critical path. (Per group, not per request: one forward pass per sample would
        cost more than it hides; filtered groups need none.)"""
        super().start(stream, reference)
        self._ref_cursor = 0
        # A stream of several domains (DomainMixer) gets one lane per domain.
        probs = getattr(stream, "probs", None)
        self.domain_lanes = DomainLanes(probs, self.want) if probs else None

    def next_batch(self) -> tuple[Batch, dict[str, float]]:
        """The next ``prompts_per_step`` complete, fresh-enough groups (blocks until there are)."""
        t0 = time.perf_counter()
        step = self.budget.steps_started + 1
        if step == 1:  # idle time is counted from the first request on, not from the warm-up
            self._idle_since = {w: t0 for w in self._idle_since}
            self.stats["time/idle/actor_infer_s"] = 0.0
        chosen = self.chosen
        fallback = 0
        while len(chosen) < self.want:
            waiting = []  # groups whose domain's quota for this step is full: they wait for the next
            while self.ready and len(chosen) < self.want:
                version, group = self.ready.pop(0)
                if self.budget.too_stale(version, step):
                    self.stats["rollout/dropped_stale_groups"] += 1
                elif self._fits(group, chosen, step):
                    chosen.append((version, group))
                else:
                    waiting.append((version, group))
            self.ready[:0] = waiting
            if len(chosen) < self.want and self.sampling.exhausted():
                # As the sync path after max_rounds: train on groups the filter rejected (for GRPO
                # their advantages are zero) rather than generate forever, and say so.
                fresh = [(v, g) for v, g in self.rejected if not self.budget.too_stale(v, step)]
                take: list[tuple[int, Batch]] = []
                for v, g in fresh:
                    if len(chosen) + len(take) < self.want and self._fits(g, chosen + take, step):
                        take.append((v, g))
                chosen += take
                fallback += len(take)
                self.rejected = [e for e in fresh if all(e is not t for t in take)]  # stale ones could never be taken
            if len(chosen) < self.want and self._pump([]) is None:
                # Nothing in flight and nothing allowed to start: waiting would spin forever.
                raise RollError(
                    f"async scheduler stalled at step {step}: {len(chosen)} of {self.want} groups, nothing in "
                    f"flight and nothing admissible (version {self.budget.version}, outstanding {self.outstanding()}, "
                    f"ratio {self.budget.ratio}); please report this with your rollout config")
        self.budget.steps_started, self.chosen = step, []
        staleness = [self.budget.staleness(v, step) for v, _ in chosen]
        batch = Batch.concat([g for _, g in chosen])
        # Group ids 0..want-1 in batch order, as the estimators expect.
        batch.update(group_index=torch.arange(len(chosen)).repeat_interleave(self.group_size))
        self.rejected.clear()
        self._abort_hopeless(step)
        self.sampling.kept, self.sampling.fallback = len(chosen) - fallback, fallback
        metrics = self._step_metrics(staleness)
        metrics["time/wait_for_batch_s"] = time.perf_counter() - t0  # the trainer's idle time
        self._top_up()  # with ratio > 0, the next batch starts generating now
        return batch, metrics

    def wait(self, future):
        """Block until ``future`` (e.g. a train step) finishes, generating and scoring meanwhile."""
        while not self._pump([future]):
            pass
        return self.executor.get(future)

    def weights_pushed(self) -> None:
        """The pipeline has queued a weight update on every inference worker."""
        self.budget.version += 1
        self._top_up()

    def stop(self) -> None:
        """Abort everything in flight at the end of a run and wait until every inference worker is
        free, so no request outlives it. Discarded groups are counted as aborted."""
        self.stats["rollout/aborted_groups"] += len(self.open) + len(self.ready) + sum(
            len(groups) for groups in self.referencing)
        self.open.clear()
        self.pending.clear()
        self.ready.clear()
        self._cancel(list(self.requests))
        self.accepting = False
        try:
            while self.inflight:
                self._pump([])
        finally:
            self.accepting = True
        self.ready.clear()  # groups whose reference log-probs came in meanwhile (already counted)

    # ------------------------------------------------------------------------------------------
    # metrics
    # ------------------------------------------------------------------------------------------
    def _mark_busy(self, worker: int) -> None:
        start = self._idle_since.pop(worker, None)
        if start is not None:
            self.stats["time/idle/actor_infer_s"] += time.perf_counter() - start

    def _idle_metric(self) -> float:
        """Mean seconds per inference worker since the last batch with no request queued on it
        (as the controller sees it: a request counts from its submission to its result)."""
        now = time.perf_counter()
        for worker, start in self._idle_since.items():  # close the open intervals at the step boundary
            self.stats["time/idle/actor_infer_s"] += now - start
            self._idle_since[worker] = now
        return self.stats["time/idle/actor_infer_s"] / len(self.infer)

    def _reset_step_stats(self) -> None:
        self.stats: dict[str, float] = defaultdict(float, {
            "time/driver_wait_s": 0.0, "time/reward_s": 0.0, "time/idle/actor_infer_s": 0.0,
            "rollout/dropped_stale_groups": 0, "rollout/aborted_groups": 0,
            "rollout/requests": 0, "rollout/aborted_requests": 0})
        self._scores: list[torch.Tensor] = []

    def _step_metrics(self, staleness: list[int]) -> dict[str, float]:
        scores = self._scores
        self.stats["time/idle/actor_infer_s"] = self._idle_metric()
        out = {k: float(v) for k, v in self.stats.items()}
        hist = Counter(staleness)
        out.update({f"rollout/staleness_{k}": float(hist.get(k, 0)) for k in range(self.budget.max_stale + 1)})
        out["rollout/staleness_mean"] = sum(staleness) / len(staleness)
        out["rollout/staleness_max"] = float(max(staleness))
        out["rollout/in_flight_groups"] = float(self.outstanding())
        if scores:
            out["reward/generated_mean"] = float(torch.cat(scores).mean())
        out.update(self.sampling.metrics())
        self._reset_step_stats()
        return out
