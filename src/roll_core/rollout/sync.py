"""``sync``: generate every group of the step, scoring each generation request as soon as it finishes.

The trivial case of the scheduler interface (:mod:`roll_core.rollout`): ``next_batch`` draws
``prompts_per_step`` prompts, generates and scores them, and with dynamic sampling draws further
rounds until the batch is full; the trainer then works alone (``wait`` only waits).

The step's samples are split into one contiguous chunk per inference worker and, with
``rollout.request_size``, each chunk into requests of that many samples. Every request is queued on
its worker up front (a worker runs its requests in order, so its sampling RNG draws the same numbers
whatever the timing, and the ``local`` and ``ray`` executors agree). When a request finishes its
samples go straight to the reward workers of their domain, which score them while the next
requests generate; the step ends when the last score is in. Training waits for the whole step:
asynchronous training is a different scheduler under the same interface.

:meth:`SyncRolloutScheduler.prefetch` sends the next step's first round right behind the weight
update (the pipeline calls it under the hybrid engine, whose worker runs its calls in order): the
same prompts, requests and random draws as without it, but the worker generates while the driver
logs the step and prepares the next. Measured by ``benchmarks/ray_calls.py``.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from roll_core.algorithms.shaping import outcome_token_rewards
from roll_core.data import Batch
from roll_core.multimodal import encode_prompts
from roll_core.multimodal import tokenize_prompts as tokenize_prompts  # its home before images; plugins import it here
from roll_core.rewards import RewardInput
from roll_core.rollout import RolloutScheduler
from roll_core.rollout.dynamic_sampling import DynamicSampling
from roll_core.strategies.sequences import response_end_ids


def expand_rows(tokenizer, rows: list[dict], num_return_sequences: int) -> Batch:
    """One row per sample (each prompt repeated ``num_return_sequences`` times, as its group).

    Each row's prompt (and its images) is encoded once and repeated: tokenizing all 256 samples of
    a quickstart step took about 5 ms of the driver's time per step, 6% of the step on Ray."""
    expanded = [row for row in rows for _ in range(num_return_sequences)]
    group_index = torch.arange(len(rows)).repeat_interleave(num_return_sequences)
    prompts = {k: v.repeat_interleave(num_return_sequences, dim=0) for k, v in encode_prompts(tokenizer, rows).items()}
    return Batch(
        {**prompts, "group_index": group_index},
        {
            "prompt": [r["prompt"] for r in expanded],
            "ground_truth": [r["ground_truth"] for r in expanded],
            "domain": [r.get("domain", "default") for r in expanded],
        },
    )


@dataclass
class _Requests:
    """Generation requests in flight: ``(future, row-order index)`` each, and when they were sent
    (None: prefetched, timed from when a step starts waiting for them)."""

    pending: list[tuple[object, int]]
    sent_at: float | None
    workers: list[int]  # the inference worker of each request, in the order of ``pending``


class SyncRolloutScheduler(RolloutScheduler):
    def __init__(self, config, executor, infer_group, reward_router, tokenizer):
        super().__init__(config, executor, infer_group, reward_router, tokenizer)
        self.last_metrics: dict[str, float] = {}  # timings of the latest collect
        self.sampling = DynamicSampling(config.algorithm.dynamic_sampling, config.rollout.prompts_per_step)
        self._prefetched: _Requests | None = None  # the next step's first round, sent early (prefetch)

    def next_batch(self) -> tuple[Batch, dict[str, float]]:
        """Rounds of ``prompts_per_step`` prompts until the filter has passed that many groups or
        ``max_rounds`` rounds were drawn; without any group passing, the last round as it is."""
        rollout, ds = self.config.rollout, self.sampling
        want = rollout.prompts_per_step
        kept: list[Batch] = []
        generated: list[torch.Tensor] = []
        timings: dict[str, float] = {}
        batch = None
        while ds.kept < want and ds.rounds_left():
            requests, self._prefetched = self._prefetched, None
            if requests is None:
                requests = self._send(self.stream.next(want), rollout.num_return_sequences, rollout.temperature)
            batch = self._receive(requests)
            for k, v in self.last_metrics.items():
                timings[k] = timings.get(k, 0.0) + v
            # Group ids unique across rounds, so groups from different rounds never mix.
            batch.update(group_index=batch["group_index"] + ds.rounds * want)
            ds.rounds += 1
            generated.append(batch["scores"])
            groups = batch["group_index"][ds.keep(batch["scores"], batch["group_index"])].unique()[: want - ds.kept]
            if len(groups):
                kept.append(batch.select(torch.isin(batch["group_index"], groups)))
                ds.kept += len(groups)
        assert batch is not None  # max_rounds >= 1
        if kept:
            batch = Batch.concat(kept)
        else:  # nothing passed within max_rounds: the last round as it is (zero GRPO advantages)
            ds.fallback = want
        # Group ids 0..want-1 in batch order, as the estimators expect.
        batch.update(group_index=torch.unique_consecutive(batch["group_index"], return_inverse=True)[1])
        return batch, {**timings, "reward/generated_mean": float(torch.cat(generated).mean()), **ds.metrics()}

    def _sampling(self, temperature: float) -> dict:
        """Keyword arguments of every ``generate`` request."""
        return self.config.rollout.sampling(temperature)

    @functools.cached_property
    def end_ids(self) -> torch.Tensor:
        """The ids that end a response, at each of which the engines stop
        (:func:`~roll_core.strategies.sequences.response_end_ids`): the tokenizer's EOS and every
        one the model's files name."""
        return torch.tensor(response_end_ids(self.tokenizer.name_or_path, self.tokenizer), dtype=torch.long)

    def _finish_request(self, part: Batch) -> tuple[Batch, list[RewardInput]]:
        """Decode one finished request, mark truncations, and build its reward inputs."""
        max_new = self.config.rollout.max_new_tokens
        lengths = part["response_mask"].sum(-1)
        last = part["responses"].gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
        # Cut off at max_new_tokens without ending (for algorithm.max_length_mask).
        part.update(truncated=(lengths >= max_new) & ~torch.isin(last, self.end_ids))
        texts = self.tokenizer.batch_decode(part["responses"], skip_special_tokens=True)
        part.update(response_text=texts)
        samples = [RewardInput(p, t, g, d)
                   for p, t, g, d in zip(part["prompt"], texts, part["ground_truth"], part["domain"])]
        return part, samples

    def prefetch(self) -> None:
        """Send the next step's first round of requests now (see :meth:`RolloutScheduler.prefetch`)."""
        if self._prefetched is None:
            rollout = self.config.rollout
            self._prefetched = self._send(self.stream.next(rollout.prompts_per_step),
                                          rollout.num_return_sequences, rollout.temperature)
            self._prefetched.sent_at = None  # the step that takes them waits from its own start

    def stop(self) -> None:
        if self._prefetched is not None:  # a run that ends early: the requests finish, unread
            self.executor.get([future for future, _ in self._prefetched.pending])
            self._prefetched = None

    def collect(self, rows, *, num_return_sequences, temperature):
        return self._receive(self._send(rows, num_return_sequences, temperature))

    def _send(self, rows: list[dict], num_return_sequences: int, temperature: float) -> _Requests:
        """Queue the generation requests of ``rows`` on the inference workers."""
        rollout = self.config.rollout
        batch = expand_rows(self.tokenizer, rows, num_return_sequences)
        requests = []  # (worker, request) in submission order = row order
        for w, chunk in enumerate(batch.chunk(len(self.infer))):
            for part in chunk.split(rollout.request_size or max(len(chunk), 1)) if len(chunk) else []:
                requests.append((w, part))
        sent_at = time.perf_counter()
        pending = [(self.executor.invoke(self.infer.handles[w], "generate", (part,), self._sampling(temperature)), i)
                   for i, (w, part) in enumerate(requests)]
        return _Requests(pending, sent_at, [w for w, _ in requests])

    def _receive(self, requests: _Requests) -> Batch:
        """Score each request as it finishes; the scored batch in row order."""
        t0 = requests.sent_at if requests.sent_at is not None else time.perf_counter()
        pending = requests.pending
        done: list[Batch | None] = [None] * len(pending)
        tickets: list = [None] * len(pending)
        while pending:
            ready = set(self.executor.wait([f for f, _ in pending]))
            for future, i in [p for k, p in enumerate(pending) if k in ready]:
                done[i], samples = self._finish_request(self.executor.get(future))
                tickets[i] = self.reward.submit(samples)
            pending = [p for k, p in enumerate(pending) if k not in ready]
        t_generated = time.perf_counter()
        generate_s = t_generated - t0
        # requests sent with a worker's other calls as one task returned with them: their own seconds
        # as the workers timed them, summed per worker (each runs its requests in turn)
        ran = [self.executor.call_seconds(future) for future, _ in requests.pending]
        if ran and None not in ran:
            per_worker: dict[int, float] = {}
            for w, seconds in zip(requests.workers, ran):
                per_worker[w] = per_worker.get(w, 0.0) + seconds
            generate_s = max(per_worker.values())
        scores, components, reward_seconds = [], [], 0.0
        for ticket in tickets:
            s, c, sec = self.reward.gather(ticket)
            scores += s
            components += c
            reward_seconds += sec
        t_scored = time.perf_counter()
        self.last_metrics = {
            "time/generate_s": generate_s,
            "time/reward_s": reward_seconds,  # summed over reward calls, overlapping generation
            "time/reward_wait_s": t_scored - t_generated,  # scoring left after the last generation
        }
        batch = Batch.concat([part for part in done if part is not None])  # every request has answered
        scores_t = torch.tensor(scores, dtype=torch.float32)
        return batch.update(
            scores=scores_t,
            reward_components=components,
            token_level_rewards=outcome_token_rewards(scores_t, batch["response_mask"]),
        )
