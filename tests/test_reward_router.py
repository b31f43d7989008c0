"""``RewardRouter``'s bookkeeping, on workers whose results the test writes: how one submission is
spread over a group, and how ``gather`` adds up the workers' seconds, failure counts and counters,
replaces a worker whose call hung and stops it once nothing is queued on it.

The rewards that actually misbehave (NaN, hanging, rejected options) and the whole runs on Ray are
in ``test_reward_failures.py``; these tests run in milliseconds, so mutation testing can afford them.
"""

from roll_core.rewards import RewardInput
from roll_core.rollout.rewards import RewardRouter
from roll_core.runtime import LocalExecutor


def result(n, *, seconds=0.0, timeouts=0, nonfinite=0, counters=None, replace=False, score=1.0):
    """What ``RewardWorker.score_detailed`` returns for ``n`` samples."""
    return {"scores": [score] * n, "components": {"judge": [score] * n}, "seconds": seconds,
            "timeouts": timeouts, "nonfinite": nonfinite, "replace": replace, "counters": counters or {}}


class Scripted:
    """A reward worker that answers its calls with ``results`` in turn (``result`` keyword arguments),
    and records its ``ready`` call and every batch it scored."""

    def __init__(self, name, *results):
        self.name, self.results, self.calls, self.readied = name, results, [], False

    def ready(self):
        self.readied = True

    def score_detailed(self, samples):
        spec = self.results[len(self.calls) % len(self.results)] if self.results else {}
        self.calls.append([s.response for s in samples])
        return result(len(samples), **spec)


def samples(n, domain="default"):
    return [RewardInput("p", f"r{i}", "g", domain) for i in range(n)]


def spawn(*workers, role="reward"):
    """A group of Scripted workers, each given as ``(name, *results)``."""
    return LocalExecutor().spawn(role, Scripted, list(workers))


def test_a_ticket_is_spread_evenly_over_the_group_and_gathered_in_submission_order():
    group = spawn(("a",), ("b",), ("c",))
    router = RewardRouter(group)
    ticket = router.submit(samples(7))
    assert [w.calls for w in group.handles] == [[["r0", "r1", "r2"]], [["r3", "r4"]], [["r5", "r6"]]]
    scores, components, _ = router.gather(ticket)
    assert scores == [1.0] * 7 and components == [{"judge": 1.0}] * 7
    # fewer samples than workers: one call per sample, no empty calls
    assert len(router.submit(samples(2)).parts) == 2


def test_single_samples_take_the_workers_of_a_group_in_turn():
    group = spawn(("a",), ("b",), ("c",))
    router = RewardRouter(group)
    tickets = [router.submit(samples(1)) for _ in range(4)]
    assert [t.parts[0][2] for t in tickets] == [0, 1, 2, 0]  # forward, round and round


def test_gather_adds_up_seconds_failures_and_counters_over_the_calls_of_a_ticket_and_over_tickets():
    group = spawn(("a", {"seconds": 0.25, "timeouts": 1, "nonfinite": 2, "counters": {"judge/retries": 3.0}}),
                  ("b", {"seconds": 0.5, "timeouts": 4, "nonfinite": 1, "counters": {"judge/retries": 1.0}}))
    router = RewardRouter(group)
    _, _, seconds = router.gather(router.submit(samples(4)))  # two calls, one per worker
    assert seconds == 0.75  # worker seconds summed, not the last call's
    router.gather(router.submit(samples(2)))  # a second ticket in the same step adds to the counts
    assert router.pop_failures() == {"reward/timeouts": 10.0, "reward/nonfinite": 6.0,
                                     "reward/replaced_workers": 0.0, "reward/judge/retries": 8.0}
    assert router.pop_failures() == {"reward/timeouts": 0.0, "reward/nonfinite": 0.0,
                                     "reward/replaced_workers": 0.0, "reward/judge/retries": 0.0}


def test_each_domain_scores_on_its_own_group_and_unknown_domains_on_the_default():
    default, code = spawn(("default",)), spawn(("code",), role="reward/code")
    router = RewardRouter(default, {"code": code})
    assert router.group_of("code") is code and router.group_of("math") is default
    assert router.groups() == [default, code]
    mixed = [*samples(1, "code"), *samples(1, "math"), *samples(1, "code")]
    router.gather(router.submit(mixed))
    assert code.handles[0].calls == [["r0", "r0"]] and default.handles[0].calls == [["r0"]]


def test_a_worker_whose_call_hung_is_replaced_once_readied_and_counted_and_stopped_when_drained():
    executor = LocalExecutor()
    stopped = []
    executor.stop = stopped.append
    group = executor.spawn("reward", Scripted, [("a", {"replace": True}), ("b",)])
    router = RewardRouter(group)
    old_a, b = group.handles
    first, second = router.submit(samples(2)), router.submit(samples(2))  # each call of both on a and b
    router.gather(first)
    fresh = group.handles[0]
    assert fresh is not old_a and group.handles[1] is b  # only the worker that asked
    assert fresh.readied and fresh.calls == []  # readied before it serves anything
    assert stopped == []  # the old one still owes the second ticket's call
    router.gather(second)  # it asks again: it is no longer the group's, so no second replacement
    assert stopped == [old_a] and group.handles[0] is fresh
    router.gather(router.submit(samples(2)))  # the fresh worker hangs too: it is the group's, so it goes in turn
    assert fresh.calls == [["r0"]] and stopped == [old_a, fresh] and group.handles[0] not in (old_a, fresh)
    assert router.pop_failures()["reward/replaced_workers"] == 2.0  # both replacements, in the same step


def test_the_run_s_reward_roles_score_with_their_configured_weights(roll_plugins, tmp_path):
    """From the config to the workers: a domain's rewards summed with their weights, the eval reward
    a router of its own."""
    from roll_core.config import load_and_check
    from roll_core.pipelines.runtime import RoleGroups
    from roll_core.rewards import Reward
    from roll_core.testing import hooks

    class One(Reward):
        lightweight = True

        def score(self, sample):
            return 1.0

    plugins = roll_plugins(("mine", hooks(roll_register_rewards=lambda register: register("one", One))))
    cfg = load_and_check(None, [f"output_dir={tmp_path}", "executor=local", "roles.reward.name=one",
                                "roles.domain_rewards={b: {rewards: [{name: one, weight: 2.0}, "
                                "{name: one, weight: 0.5}]}}",
                                "roles.eval_reward={name: one}"])
    roles = RoleGroups(cfg, LocalExecutor(), plugins)
    router, judge = roles.rewards(), roles.eval_rewards()
    samples = [RewardInput("1+1=", "2", "2", "a"), RewardInput("1+1=", "2", "2", "b")]
    assert router.gather(router.submit(samples))[0] == [1.0, 2.5]
    assert judge.gather(judge.submit(samples))[0] == [1.0, 1.0] and judge.default.role == "eval_reward"
    assert RoleGroups(load_and_check(None, [f"output_dir={tmp_path}"]), LocalExecutor(), plugins).eval_rewards() is None


def test_an_eval_reward_that_cannot_start_stops_the_run_before_it_trains(roll_plugins, tmp_path):
    import pytest

    from roll_core.config import load_and_check
    from roll_core.errors import RollError
    from roll_core.pipelines.runtime import RoleGroups
    from roll_core.rewards import Reward
    from roll_core.testing import hooks

    class NoService(Reward):
        def __init__(self):
            raise ConnectionError("no judge at localhost:9")

        def score(self, sample):
            return 0.0

    plugins = roll_plugins(("mine", hooks(roll_register_rewards=lambda register: register("judge", NoService))))
    cfg = load_and_check(None, [f"output_dir={tmp_path}", "executor=local", "roles.eval_reward={name: judge}"])
    with pytest.raises(RollError, match=r"key 'roles.eval_reward': reward 'judge' \(plugin 'mine'\) failed to start"):
        RoleGroups(cfg, LocalExecutor(), plugins).eval_rewards()
