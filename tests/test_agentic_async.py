"""Env workers and environment-level asynchronous rollout: a hung environment is replaced and its
worker keeps serving; concurrent requests meet in one policy call; groups are handed out and taken
under the staleness bound."""

from __future__ import annotations

import threading
import time
import types

import pytest

from roll_core import hookimpl
from roll_core.envs import Env


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
    roll_plugins(("sleepy", types.SimpleNamespace(roll_register_envs=hookimpl(lambda register: register("sleepy", Sleepy)))))


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


def test_requests_waiting_together_go_to_the_policy_in_one_call():
    from roll_core.agentic.async_rollout import RequestBatcher

    sizes, gate = [], threading.Event()

    def policy(conversations, envs):
        sizes.append(len(conversations))
        gate.wait(5)  # the first call holds the dispatcher while the others queue up
        return [([len(c)], [0.0]) for c in conversations]

    batcher = RequestBatcher(policy)
    replies = {}
    threads = [threading.Thread(target=lambda i=i: replies.__setitem__(i, batcher([0] * i, None))) for i in range(1, 6)]
    threads[0].start()
    time.sleep(0.2)
    for t in threads[1:]:
        t.start()
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join(5)
    batcher.close()
    assert sizes == [1, 4] and replies == {i: ([i], [0.0]) for i in range(1, 6)}  # each caller its own reply


def _loops(ratio, groups_per_step=2, group_size=3, slots=6):
    from roll_core.agentic.async_rollout import EnvLoops, Lane, RequestBatcher
    from roll_core.agentic.episodes import Rules

    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [1] * len(text)}

        def decode(self, ids, skip_special_tokens=True):
            return "0"

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
