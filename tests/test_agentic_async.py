"""Env workers and environment-level asynchronous rollout: a hung environment is replaced and its
worker keeps serving; concurrent requests meet in one policy call; groups are handed out and taken
under the staleness bound."""

from __future__ import annotations

import os
import threading
import time

import pytest

from roll_core.envs import Env
from roll_core.testing import hooks


class Sleepy(Env):
    """Step sleeps ``seconds`` (the action's number); done after 2 steps; reward = the seed's parity."""

    def reset(self, seed=None):
        self.seed, self.n = seed or 0, 0
        return f"s{self.seed}", {"state_hash": self.seed}

    def step(self, action):
        time.sleep(float(action or 0))
        self.n += 1
        return "o", float(self.seed % 2), self.n >= 2, False, {"success": self.seed % 2 == 1}


@pytest.fixture
def sleepy(roll_plugins):
    roll_plugins(("sleepy", hooks(
        roll_register_envs=lambda register: register("sleepy", Sleepy))))


def test_a_hung_environment_is_abandoned_replaced_and_its_worker_keeps_serving(sleepy):
    from roll_core.agentic.env_workers import EnvHung, EnvWorker

    worker = EnvWorker("sleepy", {}, num_envs=2, timeout_s=0.3)
    worker.reset(0, 1)
    worker.reset(1, 2)
    first_env = worker.slots[0]
    t0 = time.perf_counter()
    with pytest.raises(EnvHung, match="did not return from step within agentic.step_timeout_s=0.3 s"):
        worker.step(0, "30")
    assert time.perf_counter() - t0 < 2 and worker.replaced_count() == 1 and worker.slots[0] is None
    assert worker.step(1, "0")[1] == 0.0  # the other slot is untouched
    assert worker.reset(0, 5) == ("s5", {"state_hash": 5}) and worker.slots[0] is not first_env


def test_a_raising_environment_is_rebuilt_for_its_next_episode(sleepy):
    from roll_core.agentic.env_workers import EnvFailed, EnvWorker

    worker = EnvWorker("sleepy", {}, num_envs=1, timeout_s=5)
    worker.reset(0, 1)
    broken = worker.slots[0]
    with pytest.raises(EnvFailed, match="step: ValueError: could not convert"):
        worker.step(0, "not a number")
    assert worker.slots[0] is None and worker.reset(0, 3)[0] == "s3" and worker.slots[0] is not broken


class Counter(Env):
    """Counts its steps from ``start`` (an option); the expert says the next count; records closes."""

    actions = ("up", "down")
    closed: list = []

    def __init__(self, start=0):
        self.start = self.n = start

    def reset(self, seed=None):
        if seed is not None and seed < 0:
            raise ValueError("seeds are >= 0")
        self.n = self.start
        return f"at {self.n}", {"seed": seed}

    def step(self, action):
        self.n += 1
        return f"at {self.n} after {action}", 1.0, False, self.n >= 3, {}

    def expert_action(self):
        return f"to {self.n + 1}"

    def close(self):
        Counter.closed.append(self)


@pytest.fixture
def counter(roll_plugins):
    Counter.closed = []
    roll_plugins(("counter", hooks(
        roll_register_envs=lambda register: register("counter", Counter))))


def test_each_slot_builds_its_environment_with_the_options_on_first_use_and_keeps_it(counter, monkeypatch):
    from roll_core.agentic.env_workers import EnvWorker

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    options = {"start": 1}
    worker = EnvWorker("counter", options, num_envs=3, timeout_s=5)
    options["start"] = 99  # the worker took a copy
    assert worker.slots == [None, None, None]  # nothing is built before a slot's first call
    assert worker.reset(1, 7) == ("at 1", {"seed": 7})
    assert worker.slots[0] is None and worker.slots[2] is None
    env = worker.slots[1]
    assert worker.step(1, "up") == ("at 2 after up", 1.0, False, False, {})
    assert worker.expert_action(1) == "to 3" and worker.slots[1] is env  # the same environment throughout
    assert worker.step(1, "down")[3] is True  # truncated at 3
    assert worker.expert_action(0) == "to 2"  # slot 0 built by this call, at its options' start
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"  # tokenizers single-threaded: environments may fork


def test_close_closes_each_built_environment_once_and_empties_the_slots(counter):
    from roll_core.agentic.env_workers import EnvWorker

    worker = EnvWorker("counter", {}, num_envs=3, timeout_s=5)
    worker.reset(0, None)
    worker.reset(2, None)
    built = [worker.slots[0], worker.slots[2]]
    worker.close()
    assert Counter.closed == built and worker.slots == [None, None, None]
    worker.reset(1, None)  # still serves: a fresh environment
    assert worker.slots[1] is not None and worker.slots[1] not in built


def test_a_remote_env_calls_its_own_slot_of_the_worker_through_the_executor(counter):
    from roll_core.agentic.env_workers import EnvWorker, RemoteEnv
    from roll_core.runtime.executor import LocalExecutor

    executor = LocalExecutor()
    (handle,) = executor.spawn("env", EnvWorker, [("counter", {"start": 5}, 2, 5.0)]).handles
    first, second = (RemoteEnv(executor, handle, slot, Counter) for slot in (0, 1))
    assert second.actions == ("up", "down")
    assert second.reset(seed=3) == ("at 5", {"seed": 3}) and handle.slots[0] is None
    assert second.step("up") == ("at 6 after up", 1.0, False, True, {})
    assert second.expert_action() == "to 7"
    assert first.reset() == ("at 5", {"seed": None}) and first.expert_action() == "to 6"
    assert second.expert_action() == "to 7"  # slot 1 kept its own state


def test_a_raising_reset_names_the_call_and_the_error_without_the_worker_s_traceback(counter, monkeypatch):
    from roll_core.agentic.env_workers import EnvFailed, EnvWorker

    worker = EnvWorker("counter", {}, num_envs=2, timeout_s=5)
    with pytest.raises(EnvFailed, match=r"^reset: ValueError: seeds are >= 0$") as failed:
        worker.reset(1, -1)
    assert failed.value.__cause__ is None and failed.value.__suppress_context__
    assert worker.slots[1] is None and worker.replaced_count() == 0  # rebuilt next time, not counted as hung
    assert len(Counter.closed) == 1  # closed as it was dropped: what it holds goes with it

    def broken_close(self):
        raise OSError("the simulator is gone")

    monkeypatch.setattr(Counter, "close", broken_close)
    with pytest.raises(EnvFailed, match=r"^reset: ValueError: seeds are >= 0$"):  # the close's error is not it
        worker.reset(1, -1)
    odd = EnvWorker("counter", {"start": "x"}, num_envs=1, timeout_s=5)
    with pytest.raises(EnvFailed, match=r"^expert_action: TypeError: "):
        odd.expert_action(0)


def test_a_hung_call_names_the_environment_and_leaves_its_thread_named_after_the_slot_and_call(sleepy):
    from roll_core.agentic.env_workers import EnvHung, EnvWorker

    worker = EnvWorker("sleepy", {}, num_envs=2, timeout_s=0.2)
    worker.reset(1, 3)
    with pytest.raises(EnvHung, match=r"^environment 'sleepy' did not return from step within "
                                      r"agentic.step_timeout_s=0.2 s; it was replaced$") as hung:
        worker.step(1, "2")
    assert hung.value.__cause__ is None and hung.value.__suppress_context__
    assert "env-sleepy-1-step" in [t.name for t in threading.enumerate()]  # the abandoned call, still running
    worker.reset(0, 1)
    with pytest.raises(EnvHung):
        worker.step(0, "2")
    assert worker.replaced_count() == 2


class Tok:
    """A tokenizer that needs no files: a token per character, every reply read as "0" (no sleep)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1] * len(text)}

    def decode(self, ids, skip_special_tokens=True):
        return "0"


def _loops(ratio, groups_per_step=2, group_size=3, slots=6):
    from roll_core.agentic.async_rollout import EnvLoops, Lane, RequestBatcher
    from roll_core.agentic.episodes import Rules

    batcher = RequestBatcher(lambda convs, envs: [([7], [0.0]) for _ in convs])
    lane = Lane("sleepy", [Sleepy() for _ in range(slots)], Rules(Tok(), max_turns=4), groups_per_step,
                seed_of=lambda g: 100 + g)
    loops = EnvLoops([lane], batcher, group_size=group_size, async_generation_ratio=ratio)
    return loops, batcher


def test_on_policy_async_rollout_plays_one_step_of_groups_per_policy_version():
    loops, batcher = _loops(ratio=0.0)
    loops.start()
    episodes, metrics = loops.take()
    assert len(episodes) == 6 and [e.group for e in episodes] == [0, 0, 0, 1, 1, 1]
    assert [e.reward for e in episodes] == [0.0] * 3 + [2.0] * 3  # seeds 100 and 101, two steps each
    time.sleep(0.2)
    assert loops.lanes[0].next_episode == 6  # nothing more is handed out before the policy changes
    loops.policy_updated()
    episodes, metrics = loops.take()
    assert sorted({e.group for e in episodes}) == [2, 3] and metrics["rollout/staleness_mean"] == 0.0
    loops.stop()
    batcher.close()


def test_groups_staler_than_the_bound_are_dropped_counted_and_replaced():
    loops, batcher = _loops(ratio=1.0, slots=12)
    loops.start()
    time.sleep(0.3)  # two steps' worth of groups (0-3) are complete at version 0
    loops.take()
    loops.policy_updated()
    loops.policy_updated()  # version 2: groups 2 and 3 (version 0) are now 2 versions old, > ceil(1)
    episodes, metrics = loops.take()
    assert metrics["rollout/stale_groups_dropped"] == 2.0 and metrics["rollout/staleness_mean"] <= 1
    assert {e.group for e in episodes}.isdisjoint({0, 1, 2, 3})
    loops.stop()
    batcher.close()


# -- the batcher's rules, and the loops' counts, one by one ---------------------------------------

def _gated_batcher(max_batch=None, fail_first=False):
    """A batcher whose first policy call waits for ``gate`` (so later callers queue up behind it);
    ``sizes`` records every call's batch size."""
    from roll_core.agentic.async_rollout import RequestBatcher

    sizes, gate = [], threading.Event()

    def policy(conversations, envs):
        sizes.append(len(conversations))
        if len(sizes) == 1:
            gate.wait(5)
            if fail_first:
                raise RuntimeError("the engine died")
        return [([len(c)], [0.0]) for c in conversations]

    return RequestBatcher(policy, max_batch=max_batch), sizes, gate


def _callers(batcher, n):
    """``n`` callers started 0.1 s apart (so they queue in order); their replies or errors by index."""
    out = {}

    def call(i):
        try:
            out[i] = batcher([0] * i, None)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(1, n + 1)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    return out, threads


def _settles_at(read, value, timeout_s=5.0):
    """Whether ``read()`` reaches ``value`` (polled for up to ``timeout_s``) and stays there 0.2 s."""
    deadline = time.monotonic() + timeout_s
    while read() < value and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    return read() == value


def test_requests_waiting_together_go_to_the_policy_in_one_call():
    batcher, sizes, gate = _gated_batcher()
    out, threads = _callers(batcher, 5)  # the first call holds the dispatcher while the others queue up
    gate.set()
    for t in threads:
        t.join(5)
    batcher.close()
    assert sizes == [1, 4] and out == {i: ([i], [0.0]) for i in range(1, 6)}  # each caller its own reply


def test_max_batch_caps_each_policy_call_and_the_batcher_counts_its_calls():
    batcher, sizes, gate = _gated_batcher(max_batch=2)
    out, threads = _callers(batcher, 5)
    gate.set()
    for t in threads:
        t.join(5)
    batcher.close()
    assert sizes == [1, 2, 2] and out == {i: ([i], [0.0]) for i in range(1, 6)}
    assert (batcher.calls, batcher.requests_served) == (3, 5)


def test_a_failing_policy_call_fails_its_callers_and_the_batcher_serves_the_next():
    batcher, sizes, gate = _gated_batcher(fail_first=True)
    out, threads = _callers(batcher, 1)
    gate.set()
    threads[0].join(5)
    assert isinstance(out[1], RuntimeError) and str(out[1]) == "the engine died"
    assert batcher([0, 0], None) == ([2], [0.0]) and (batcher.calls, batcher.requests_served) == (1, 1)
    batcher.close()


def test_no_policy_call_runs_while_paused_and_close_finishes_the_queued_requests_first():
    batcher, sizes, gate = _gated_batcher()
    gate.set()
    with batcher.paused():  # a weight update: the request waits
        out, threads = _callers(batcher, 1)
        time.sleep(0.2)
        assert out == {} and sizes == []
    threads[0].join(5)
    assert out == {1: ([1], [0.0])}
    # closing with requests queued behind a running call: they are answered, then the thread ends
    batcher, sizes, gate = _gated_batcher()
    out, threads = _callers(batcher, 3)
    closing = threading.Thread(target=batcher.close)
    closing.start()
    gate.set()
    closing.join(5)
    for t in threads:
        t.join(5)
    assert not closing.is_alive() and not batcher.thread.is_alive()
    assert sizes == [1, 2] and out == {i: ([i], [0.0]) for i in (1, 2, 3)}


def test_take_counts_updates_and_takes_so_the_slots_stay_within_the_bound():
    """ratio 0, two groups of three per step: two groups out per policy version. Two takes without
    an update between them are impossible at ratio 0, so ratio 1 shows that a step's groups are
    replaced only at the next update, all takes since the last one together."""
    loops, batcher = _loops(ratio=0.0)
    loops.start()
    for version in range(3):
        loops.take()
        assert _settles_at(lambda: loops.lanes[0].next_episode, 6 * (version + 1))  # the groups released so far
        loops.policy_updated()
    loops.stop()
    batcher.close()
    loops, batcher = _loops(ratio=1.0, slots=12)
    loops.start()
    loops.take()
    loops.take()  # both steps' groups were released at once
    assert loops.lanes[0].released == 4 and _settles_at(lambda: loops.lanes[0].next_episode, 12)
    loops.policy_updated()
    assert loops.lanes[0].released == 8 and _settles_at(lambda: loops.lanes[0].next_episode, 24)
    loops.stop()
    batcher.close()


def test_a_dropped_group_is_replaced_and_a_fractional_ratio_rounds_up():
    """ratio 0.25, groups of one played by one slot (they complete in order), two a step:
    ceil(1.25 * 2) = 3 groups out at first, and groups one version old (ceil(0.25) = 1) are still
    taken. Group 4, left complete at version 1, is two versions old after two more updates:
    dropped, and one more group is released in its place."""
    loops, batcher = _loops(ratio=0.25, group_size=1, slots=1)
    loops.start()
    assert loops.lanes[0].released == 3 and _settles_at(lambda: loops.lanes[0].next_episode, 3)
    loops.take()  # groups 0, 1; group 2 (version 0) stays complete
    loops.policy_updated()
    episodes, metrics = loops.take()  # group 2 is one version old: taken, with group 3
    assert [e.group for e in episodes] == [2, 3] and metrics["rollout/staleness_mean"] == 0.5
    assert metrics["rollout/stale_groups_dropped"] == 0
    loops.policy_updated()
    loops.policy_updated()  # version 3: groups 5 and 6 (version 2 or 3) replace the two taken
    episodes, metrics = loops.take()
    assert metrics["rollout/stale_groups_dropped"] == 1 and [e.group for e in episodes] == [5, 6]
    assert loops.lanes[0].released == 8
    loops.stop()
    batcher.close()


def test_every_lane_gets_its_groups_its_seeds_and_its_label_and_stop_ends_every_loop():
    from roll_core.agentic.async_rollout import EnvLoops, Lane, RequestBatcher
    from roll_core.agentic.episodes import Rules

    def policy(conversations, envs):  # slow enough for the other slots' requests to queue behind a call
        time.sleep(0.05)
        return [([7], [0.0]) for _ in conversations]

    batcher = RequestBatcher(policy)
    lanes = [Lane("odd", [Sleepy() for _ in range(4)], Rules(Tok()), 1, seed_of=lambda g: 2 * g + 1),
             Lane("even", [Sleepy() for _ in range(4)], Rules(Tok()), 2, seed_of=lambda g: 2 * g)]
    loops = EnvLoops(lanes, batcher, group_size=2)
    loops.start()
    episodes, metrics = loops.take()
    assert metrics["rollout/requests_per_call"] == batcher.requests_served / batcher.calls > 1
    assert [(e.env, e.group, e.reward) for e in episodes] == [("odd", 0, 2.0)] * 2 + [
        ("even", 0, 0.0), ("even", 0, 0.0), ("even", 1, 0.0), ("even", 1, 0.0)]
    loops.stop()
    for thread in loops.threads:
        thread.join(5)
    assert not any(thread.is_alive() for thread in loops.threads)
    batcher.close()
