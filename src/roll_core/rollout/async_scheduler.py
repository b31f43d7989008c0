"""``async``: rollout that never stops for training, with bounded staleness (after ROLL Flash).

The synchronous loop leaves the inference workers idle while the policy trains and the trainer idle
while the slowest sample of the step finishes. This scheduler keeps a queue of generation requests
(``rollout.request_size`` samples, whole groups) on every inference worker, at most
``rollout.max_running_requests`` each, and drives them from the controller's event loop:

* a finished request is scored at once on the reward workers of its samples' domains;
* a group whose scores are in passes the dynamic-sampling filter or is dropped (counted);
* ``next_batch`` hands the trainer the first ``prompts_per_step`` complete groups, oldest first;
* while the trainer works (``wait_for``), the loop keeps generating and scoring.

Staleness. ``version`` counts the weight updates the inference workers have received. A group
generated at version ``v`` and trained on at step ``s`` (whose weights are version ``s - 1``) has
staleness ``s - 1 - v``. ``rollout.async_generation_ratio`` = ``r`` bounds it: a group is only
started if, counting the groups queued before it, it would be trained on within ``ceil(r)`` steps,
and at most ``r * prompts_per_step`` groups are generated ahead of the step being trained. A group
that is staler than ``ceil(r)`` when its turn comes (possible with redundant prompts) is dropped and
counted, never trained on. ``r = 0`` is synchronous training on the same machinery: nothing starts
before the weights of the previous step arrive.

Redundant prompts (``rollout.max_additional_running_prompts``) keep extra groups in flight so that a
batch fills without waiting for stragglers or for groups the filter rejects; groups left over when
a batch is full stay queued for the next step, and are dropped there if they became too stale.

Ordering. Weight updates go to each inference worker as an ordinary call, queued behind the requests
already sent to it (a worker runs its calls in order), so every request is generated entirely with
the weights of the version it was tagged with. The ``infer_log_probs`` of the sampler are kept in
the batch for off-policy corrections (``policy_loss: tis``).

Requests are groups, not single samples: the ``hf`` strategy generates a batch in one pass, so one
request per sample would multiply its cost. Engines with continuous batching (vLLM, SGLang) are where
``request_size`` = ``num_return_sequences`` pays off: a strategy that declares
``concurrent_requests`` gets workers that run ``max_running_requests`` requests at once, so a short
group returns while a long one still decodes (``benchmarks/bench_long_tail.py`` measures this with
long-tailed lengths).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

import torch

from roll_core.algorithms.shaping import keep_groups, outcome_token_rewards
from roll_core.data import Batch
from roll_core.errors import RollError
from roll_core.rollout.rewards import RewardTicket
from roll_core.rollout.sync import SyncRolloutScheduler, expand_rows


@dataclass
class _Request:
    future: object
    worker: int
    version: int
    groups: list[int]


@dataclass
class _Scoring:
    ticket: RewardTicket
    part: Batch
    version: int
    groups: list[int]
    done: set[int]


class AsyncRolloutScheduler(SyncRolloutScheduler):
    streaming = True

    def __init__(self, config, executor, infer_group, reward_router, tokenizer):
        super().__init__(config, executor, infer_group, reward_router, tokenizer)
        r = config.rollout
        self.ratio = r.async_generation_ratio
        self.max_stale = math.ceil(self.ratio)
        self.want = r.prompts_per_step
        self.group_size = r.num_return_sequences
        self.groups_per_request = max(1, (r.request_size or r.num_return_sequences) // r.num_return_sequences)
        self.max_running = r.max_running_requests
        self.extra = r.max_additional_running_prompts
        self.filter_cfg = config.algorithm.dynamic_sampling
        self.version = 0  # weight updates the inference workers have been sent
        self.steps_started = 0  # batches handed to the trainer
        self.stream = None
        self.next_group = 0
        self.requests: list[_Request] = []
        self.scoring: list[_Scoring] = []
        self.ready: list[tuple[int, Batch]] = []  # (version, one scored, kept group), completion order
        self.chosen: list[tuple[int, Batch]] = []  # the batch being assembled (still outstanding)
        self.rejected: list[tuple[int, Batch]] = []  # filtered out this step (only a fallback uses them)
        self.max_filtered = config.algorithm.dynamic_sampling.max_rounds * self.want
        self._cursor = 0
        self.accepting = True
        self._idle_since: dict[int, float] = {w: time.perf_counter() for w in range(len(self.infer))}
        self._reset_step_stats()

    # ------------------------------------------------------------------------------------------
    # admission: which groups may start now
    # ------------------------------------------------------------------------------------------
    def outstanding(self) -> int:
        """Groups started and neither trained on nor dropped yet."""
        return (sum(len(q.groups) for q in self.requests) + sum(len(s.groups) for s in self.scoring)
                + len(self.ready) + len(self.chosen))

    def admissible(self) -> int:
        """How many more groups may start now without breaking the staleness bound.

        A group started now is trained on after everything outstanding, i.e. at step
        ``steps_started + 1 + outstanding // want``; its staleness is that minus 1 minus ``version``.
        The bound: at most ``(1 + ratio + version - steps_started) * want`` outstanding groups."""
        if not self.accepting:
            return 0
        limit = math.floor((1 + self.ratio + self.version - self.steps_started) * self.want + 1e-9)
        # Redundant prompts only pad a batch that may be generated now, never one further ahead.
        return max(0, limit + (self.extra if limit > 0 else 0) - self.outstanding())

    def _top_up(self) -> None:
        running = Counter(q.worker for q in self.requests)
        budget = self.admissible()
        while budget > 0:
            worker = min(range(len(self.infer)), key=lambda w: (running[w], (w - self._cursor) % len(self.infer)))
            if running[worker] >= self.max_running:
                return
            n = min(self.groups_per_request, budget)
            rows = self.stream.next(n)
            groups = list(range(self.next_group, self.next_group + n))
            self.next_group += n
            batch = expand_rows(self.tokenizer, rows, self.group_size)
            batch.update(group_index=torch.tensor(groups).repeat_interleave(self.group_size))
            future = self.executor.invoke(self.infer.handles[worker], "generate", (batch,),
                                          self._sampling(self.config.rollout.temperature))
            self.requests.append(_Request(future, worker, self.version, groups))
            self._mark_busy(worker)
            self._cursor = (worker + 1) % len(self.infer)
            running[worker] += 1
            budget -= n

    # ------------------------------------------------------------------------------------------
    # the event loop
    # ------------------------------------------------------------------------------------------
    def _pump(self, extra_futures: list) -> list[int] | None:
        """Start what may start, wait for at least one event, handle it. Returns the positions in
        ``extra_futures`` that finished, or None when there was nothing to wait for."""
        self._top_up()
        gen = [q.future for q in self.requests]
        rew = [(s, k, f) for s in self.scoring for k, (f, _) in enumerate(s.ticket.parts) if k not in s.done]
        waiting = gen + [f for _, _, f in rew] + list(extra_futures)
        if not waiting:
            return None
        t0 = time.perf_counter()
        ready = set(self.executor.wait(waiting))
        self.stats["time/driver_wait_s"] += time.perf_counter() - t0
        finished = [q for k, q in enumerate(self.requests) if k in ready]
        self.requests = [q for k, q in enumerate(self.requests) if k not in ready]
        for q in finished:
            if not any(r.worker == q.worker for r in self.requests):
                self._idle_since.setdefault(q.worker, time.perf_counter())
            part, samples = self._finish_request(self.executor.get(q.future))
            self.scoring.append(_Scoring(self.reward.submit(samples), part, q.version, q.groups, set()))
        for j, (s, k, _) in enumerate(rew):
            if len(gen) + j in ready:
                s.done.add(k)
        for s in [s for s in self.scoring if len(s.done) == len(s.ticket.parts)]:
            self.scoring.remove(s)
            self._complete(s)
        self._top_up()
        offset = len(gen) + len(rew)
        return [k - offset for k in sorted(ready) if k >= offset]

    def _complete(self, s: _Scoring) -> None:
        scores, components, seconds = self.reward.gather(s.ticket)
        self.stats["time/reward_s"] += seconds
        scores_t = torch.tensor(scores, dtype=torch.float32)
        part = s.part.update(scores=scores_t, reward_components=components,
                             token_level_rewards=outcome_token_rewards(scores_t, s.part["response_mask"]))
        self._scores.append(scores_t)
        keep = keep_groups(scores_t, part["group_index"], self.filter_cfg)
        for g in s.groups:
            rows = part["group_index"] == g
            if bool(keep[rows].all()):
                self.ready.append((s.version, part.select(rows)))
            else:
                self.stats["rollout/filtered_groups"] += 1
                self.rejected.append((s.version, part.select(rows)))

    # ------------------------------------------------------------------------------------------
    # what the pipeline calls
    # ------------------------------------------------------------------------------------------
    def attach(self, stream) -> None:
        self.stream = stream

    @staticmethod
    def staleness(version: int, step: int) -> int:
        """Updates between a group's weights (``version``) and those trained at ``step`` (``step - 1``)."""
        return step - 1 - version

    def next_batch(self) -> tuple[Batch, dict[str, float]]:
        """The next ``prompts_per_step`` complete, fresh-enough groups (blocks until there are)."""
        t0 = time.perf_counter()
        step = self.steps_started + 1
        if step == 1:  # idle time is counted from the first request on, not from the warm-up
            self._idle_since = {w: t0 for w in self._idle_since}
            self.stats["time/idle/actor_infer_s"] = 0.0
        chosen = self.chosen
        fallback = 0
        while len(chosen) < self.want:
            while self.ready and len(chosen) < self.want:
                version, group = self.ready.pop(0)
                if self.staleness(version, step) > self.max_stale:
                    self.stats["rollout/dropped_stale_groups"] += 1
                    continue
                chosen.append((version, group))
            if len(chosen) < self.want and self.stats["rollout/filtered_groups"] >= self.max_filtered:
                # As the sync path after max_rounds: train on groups the filter rejected (for GRPO
                # their advantages are zero) rather than generate forever, and say so.
                fresh = [(v, g) for v, g in self.rejected if self.staleness(v, step) <= self.max_stale]
                take = fresh[: self.want - len(chosen)]
                chosen += take
                fallback += len(take)
                self.rejected = fresh[len(take):]  # stale ones could never be taken this step
            if len(chosen) < self.want and self._pump([]) is None:
                # Nothing in flight and nothing allowed to start: waiting would spin forever.
                raise RollError(
                    f"async scheduler stalled at step {step}: {len(chosen)} of {self.want} groups, nothing in "
                    f"flight and nothing admissible (version {self.version}, outstanding {self.outstanding()}, "
                    f"ratio {self.ratio}); please report this with your rollout config")
        self.steps_started, self.chosen = step, []
        staleness = [self.staleness(v, step) for v, _ in chosen]
        batch = Batch.concat([g for _, g in chosen])
        # Group ids 0..want-1 in batch order, as the estimators expect.
        batch.update(group_index=torch.arange(len(chosen)).repeat_interleave(self.group_size))
        self.rejected.clear()
        metrics = self._step_metrics(staleness)
        if fallback:
            metrics["dynamic_sampling/fallback_groups"] = float(fallback)
        metrics["time/wait_for_batch_s"] = time.perf_counter() - t0  # the trainer's idle time
        self._top_up()  # with ratio > 0, the next batch starts generating now
        return batch, metrics

    def wait_for(self, future):
        """Block until ``future`` (e.g. a train step) finishes, generating and scoring meanwhile."""
        while not self._pump([future]):
            pass
        return self.executor.get(future)

    def weights_updated(self) -> None:
        """The pipeline has queued a weight update on every inference worker."""
        self.version += 1
        self._top_up()

    def drain(self) -> None:
        """Wait for (and discard) every request in flight, at the end of a run, so none outlives it.
        Discarded groups are counted as aborted."""
        self.accepting = False
        try:
            while self.requests or self.scoring:
                self._pump([])
        finally:
            self.accepting = True
        self.stats["rollout/aborted_groups"] += len(self.ready)
        self.ready.clear()

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
        self.stats = Counter({"time/driver_wait_s": 0.0, "time/reward_s": 0.0, "time/idle/actor_infer_s": 0.0,
                              "rollout/filtered_groups": 0,
                              "rollout/dropped_stale_groups": 0, "rollout/aborted_groups": 0})
        self._scores: list[torch.Tensor] = []

    def _step_metrics(self, staleness: list[int]) -> dict[str, float]:
        scores = self._scores
        self.stats["time/idle/actor_infer_s"] = self._idle_metric()
        out = {k: float(v) for k, v in self.stats.items()}
        hist = Counter(staleness)
        out.update({f"rollout/staleness_{k}": float(hist.get(k, 0)) for k in range(self.max_stale + 1)})
        out["rollout/staleness_mean"] = sum(staleness) / len(staleness)
        out["rollout/staleness_max"] = float(max(staleness))
        out["rollout/in_flight_groups"] = float(self.outstanding())
        if scores:
            all_scores = torch.cat(scores)
            out["reward/generated_mean"] = float(all_scores.mean())
        self._reset_step_stats()
        return out
