"""The ``sync`` scheduler's step, on an engine whose answers the test writes: dynamic sampling's
rounds, which groups a batch keeps and how they are numbered, the fallback when no group passes,
the step's counts and timings, how a finished request is decoded and marked truncated, and what
the rewards are given. Milliseconds each, so mutation testing runs them.

Each prompt spells out its group's answers: sample ``j`` of the group of ``"10="`` answers ``"1"``
then ``"0"``; the ground truth is always ``"1"``, so ``"10="`` is a mixed group that the mean filter
keeps, and ``"11="`` and ``"00="`` are groups it drops. ``L`` answers ``"11"`` with no end (cut off at
``max_new_tokens=2``), ``s`` a single ``"1"`` with no end (it stopped short of the limit), ``e`` EOS alone.
"""

from __future__ import annotations

import time

import pytest
import torch

from roll_core.config.loader import load_config
from roll_core.embedded.model import build_char_tokenizer
from roll_core.rollout.sync import SyncRolloutScheduler
from roll_core.runtime import LocalExecutor
from roll_core.runtime.executor import WorkerGroup

GENERATE_S = 0.02  # each generate call's seconds


class Engine:
    """Answers sample ``j`` of each group with the ``j``-th character of its prompt (see the module's
    docstring), one token and EOS. A group's samples come in order, whatever requests carry them, so
    the ``k``-th sample of prompt ``p`` ever generated is sample ``k mod (len(p) - 1)`` of its group."""

    def __init__(self, tokenizer):
        self.tokenizer, self.seen, self.sampling = tokenizer, {}, []

    def generate(self, part, **sampling):
        tok, eos, pad = self.tokenizer.convert_tokens_to_ids, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        self.sampling.append(sampling)
        time.sleep(GENERATE_S)
        rows, masks = [], []
        for prompt in part["prompt"]:
            k = self.seen[prompt] = self.seen.get(prompt, -1) + 1
            c = prompt[k % (len(prompt) - 1)]
            rows.append({"L": [tok("1"), tok("1")], "s": [tok("1"), pad], "e": [eos, pad]}.get(c, [tok(c), eos]))
            masks.append([1, 0] if c in "se" else [1, 1])
        responses = torch.tensor(rows)
        return part.update(responses=responses, response_mask=torch.tensor(masks),
                           infer_log_probs=torch.zeros(responses.shape))


class Rewards:
    """Scores a sample 1 when its response is its ground truth, a quarter of a worker second per call,
    and records what it was given."""

    def __init__(self):
        self.samples = []

    def submit(self, samples):
        self.samples += samples
        return [float(s.response == s.ground_truth) for s in samples]

    def gather(self, ticket):
        return ticket, [{"judge": score} for score in ticket], 0.25


class OneAtATime(LocalExecutor):
    """Reports one finished request per ``wait``, as Ray does when requests finish in turn, and records
    what ``get`` was asked for."""

    def __init__(self):
        super().__init__()
        self.got = []

    def wait(self, futures):
        return [0]

    def get(self, futures):
        self.got.append(futures)
        return futures


class Rows:
    """Rows in the order given (a stream that does not shuffle), each a prompt or a row's fields,
    ground truth ``"1"``."""

    def __init__(self, *rows):
        self.rows = [{"ground_truth": "1", **({"prompt": r} if isinstance(r, str) else r)} for r in rows]
        self.drawn = 0

    def next(self, n):
        self.drawn += n
        return self.rows[self.drawn - n:self.drawn]


def scheduler(*rows, executor=None, **overrides):
    settings = {"rollout.prompts_per_step": 2, "rollout.num_return_sequences": 2, "rollout.max_new_tokens": 2,
                "rollout.temperature": 0.7, "algorithm.dynamic_sampling.filter": "mean",
                "algorithm.dynamic_sampling.max_rounds": 3, **overrides}
    config = load_config(None, [f"{k}={v}" for k, v in settings.items()])
    tokenizer = build_char_tokenizer()
    executor = executor or LocalExecutor()
    out = SyncRolloutScheduler(config, executor, WorkerGroup("actor_infer", [Engine(tokenizer)], executor),
                               Rewards(), tokenizer)
    out.start(Rows(*rows))
    return out


def engine(sync) -> Engine:
    return sync.infer.handles[0]


def test_rounds_are_drawn_until_the_step_has_its_groups_and_only_as_many_as_it_wants_are_kept():
    sync = scheduler("11=", "10=", "01=", "10=", "00=", "00=", "11=", "11=", "10=", "01=")
    batch, metrics = sync.next_batch()
    # round 1 keeps "10=" and drops "11="; round 2 passes both, and the first is the one still wanted
    assert batch["prompt"] == ["10=", "10=", "01=", "01="]
    assert batch["group_index"].tolist() == [0, 0, 1, 1]  # renumbered in batch order
    assert batch["scores"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert metrics["rollout/filtered_groups"] == 1.0 and metrics["rollout/kept_groups"] == 2.0
    assert metrics["rollout/fallback_groups"] == 0.0 and metrics["rollout/sampling_rounds"] == 2.0
    assert metrics["reward/generated_mean"] == 0.625  # over both rounds' 8 samples: 1 1 1 0 | 0 1 1 0
    assert sync.stream.drawn == 4  # the third round was never drawn
    # the next step counts afresh: two rounds dropped whole, the third kept whole
    batch, metrics = sync.next_batch()
    assert metrics["rollout/sampling_rounds"] == 3.0 and metrics["rollout/filtered_groups"] == 4.0
    assert batch["prompt"] == ["10=", "10=", "01=", "01="] and sync.stream.drawn == 10


def test_groups_from_different_rounds_never_merge():
    # group 1 of the first round and group 0 of the third are kept, side by side in the batch
    sync = scheduler("11=", "10=", "00=", "11=", "01=", "11=")
    batch, metrics = sync.next_batch()
    assert batch["group_index"].tolist() == [0, 0, 1, 1] and batch["prompt"] == ["10=", "10=", "01=", "01="]
    # the rounds' timings add up: 3 generate calls, 3 reward calls of 0.25 worker seconds
    assert metrics["time/reward_s"] == 0.75 and metrics["time/generate_s"] >= 3 * GENERATE_S
    assert {s["temperature"] for s in engine(sync).sampling} == {0.7}


def test_with_no_group_passing_the_last_round_is_the_batch_and_the_step_says_so():
    sync = scheduler("11=", "00=", "00=", "11=", "11=", "11=", **{"algorithm.dynamic_sampling.max_rounds": 2})
    batch, metrics = sync.next_batch()
    assert batch["prompt"] == ["00=", "00=", "11=", "11="] and batch["group_index"].tolist() == [0, 0, 1, 1]
    assert metrics["rollout/filtered_groups"] == 4.0 and metrics["rollout/kept_groups"] == 0.0
    assert metrics["rollout/fallback_groups"] == 2.0 and metrics["rollout/sampling_rounds"] == 2.0
    assert metrics["reward/generated_mean"] == 0.5


def test_groups_kept_within_the_budget_make_a_smaller_batch_not_a_fallback():
    sync = scheduler("11=", "10=", "00=", "11=", **{"algorithm.dynamic_sampling.max_rounds": 2})
    batch, metrics = sync.next_batch()
    assert batch["prompt"] == ["10=", "10="] and batch["group_index"].tolist() == [0, 0]
    assert metrics["rollout/kept_groups"] == 1.0 and metrics["rollout/fallback_groups"] == 0.0
    assert metrics["rollout/filtered_groups"] == 3.0


def test_without_a_filter_one_round_is_the_batch_and_no_sampling_counts_are_reported():
    sync = scheduler("11=", "00=", "10=", **{"algorithm.dynamic_sampling.filter": "none"})
    batch, metrics = sync.next_batch()
    assert batch["prompt"] == ["11=", "11=", "00=", "00="] and batch["group_index"].tolist() == [0, 0, 1, 1]
    assert not [k for k in metrics if k.startswith("rollout/")]
    assert metrics["reward/generated_mean"] == 0.5 and sync.stream.drawn == 2
    assert {"time/generate_s", "time/reward_s", "time/reward_wait_s"} <= metrics.keys()


def test_a_finished_request_is_decoded_and_only_a_response_cut_off_at_the_limit_is_truncated():
    sync = scheduler(**{"algorithm.dynamic_sampling.filter": "none", "rollout.num_return_sequences": 4})
    batch = sync.collect([{"prompt": "1Ls0=", "ground_truth": "1"}], num_return_sequences=4, temperature=1.0)
    assert batch["response_text"] == ["1", "11", "1", "0"]  # EOS and padding left out
    assert batch["truncated"].tolist() == [False, True, False, False]  # "s" ended short; the others in EOS
    assert batch["scores"].tolist() == [1.0, 0.0, 1.0, 0.0]
    # the outcome reward sits on each response's last token
    assert batch["token_level_rewards"].tolist() == [[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]]
    assert batch["group_index"].tolist() == [0] * 4
    assert batch["reward_components"] == [{"judge": 1.0}, {"judge": 0.0}, {"judge": 1.0}, {"judge": 0.0}]
    assert engine(sync).sampling[-1]["temperature"] == 1.0  # collect's own, not the config's 0.7


def test_an_end_as_the_only_token_at_the_limit_is_not_a_truncation():
    sync = scheduler(**{"algorithm.dynamic_sampling.filter": "none", "rollout.max_new_tokens": 1})
    batch = sync.collect([{"prompt": "eL=", "ground_truth": "1"}], num_return_sequences=2, temperature=0.0)
    assert batch["response_text"] == ["", "11"] and batch["truncated"].tolist() == [False, True]


def test_prompts_are_left_padded_repeated_per_sample_and_carry_their_domains_to_the_rewards():
    sync = scheduler({"prompt": "10="}, {"prompt": "1Ls0=", "domain": "code"},
                     **{"algorithm.dynamic_sampling.filter": "none"})
    sync.tokenizer.add_bos_token = True  # as Llama's tokenizers have it: prompts are used verbatim all the same
    sync.tokenizer.padding_side = "right"  # as many tokenizers have it: prompts are padded on the left all the same
    assert sync.tokenizer("1")["input_ids"][0] == sync.tokenizer.bos_token_id
    batch, _ = sync.next_batch()
    assert batch["domain"] == ["default", "default", "code", "code"]
    assert batch["prompt_mask"].tolist() == [[0, 0, 1, 1, 1]] * 2 + [[1, 1, 1, 1, 1]] * 2
    ids = sync.tokenizer.convert_tokens_to_ids
    assert batch["prompt_ids"][0, 2:].tolist() == ids(list("10=")) and batch["prompt_ids"][3].tolist() == ids(list("1Ls0="))
    given = sync.reward.samples
    assert [(s.prompt, s.response, s.domain) for s in given] == [
        ("10=", "1", "default"), ("10=", "0", "default"), ("1Ls0=", "1", "code"), ("1Ls0=", "11", "code")]


@pytest.mark.parametrize("size", [1, 3])
def test_requests_finishing_one_at_a_time_give_the_batch_in_row_order(size):
    sync = scheduler("10=", "01=", executor=OneAtATime(),
                     **{"algorithm.dynamic_sampling.filter": "none", "rollout.request_size": size})
    batch, metrics = sync.next_batch()
    assert batch["prompt"] == ["10=", "10=", "01=", "01="] and batch["scores"].tolist() == [1.0, 0.0, 0.0, 1.0]
    calls = -(-4 // size)  # one reward call per request
    assert metrics["time/reward_s"] == 0.25 * calls
    # generation is timed from when the requests were sent, scoring after it from the last one's end
    assert metrics["time/generate_s"] >= calls * GENERATE_S and 0.0 <= metrics["time/reward_wait_s"] < 1.0


def test_a_round_sent_early_and_never_taken_is_awaited_at_stop():
    executor = OneAtATime()
    sync = scheduler("10=", "01=", executor=executor, **{"algorithm.dynamic_sampling.filter": "none"})
    sync.prefetch()
    pending = [future for future, _ in sync._prefetched.pending]
    sync.stop()
    assert executor.got[-1] == pending and sync._prefetched is None
