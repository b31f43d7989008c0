"""The executors' call API beyond spawn/invoke/get: calls sent as one task per worker
(``one_task_per_worker``), the seconds workers report for them (``call_seconds``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from roll_core.errors import RollError
from roll_core.runtime.executor import LocalExecutor


def _recorder_class():
    """A worker that logs its calls; defined in a function so that Ray ships it by value (workers
    cannot import tests)."""
    import time

    from roll_core.runtime.worker_base import Worker

    class Recorder(Worker):
        def __init__(self):
            self.log: list = []

        def add(self, x, seconds=0.0):
            ray = sys.modules.get("ray")  # imported in a Ray worker; the local executor needs none

            time.sleep(seconds)
            self.log.append(x)
            return x, ray.get_runtime_context().get_task_id() if ray and ray.is_initialized() else None

        def fail(self, message):
            raise RollError(message)

        def seen(self):
            return self.log

        def forget(self):
            self.log = []

    return Recorder


def _closing_classes():
    """A worker whose ``close`` leaves a file (what a process's end would not undo), taking
    ``seconds`` or failing; and one without ``close``. Shipped by value, as the recorder."""
    import time
    from pathlib import Path

    class Closing:
        def __init__(self, marker, seconds=0.0, fails=False):
            self.marker, self.seconds, self.fails = Path(marker), seconds, fails

        def close(self):
            time.sleep(self.seconds)
            if self.fails:
                raise OSError("the container would not stop")
            self.marker.write_text("closed")

    class Plain:
        def ping(self):
            return "pong"

    return Closing, Plain


@pytest.fixture(scope="module")
def ray_executor():
    from roll_core.runtime.executor import RayExecutor

    executor = RayExecutor(num_cpus=2, timeout_s=60)
    yield executor
    executor.shutdown()


@pytest.fixture(scope="module")
def spawned_recorders(ray_executor):
    """Two Ray workers and a third hosting a worker of role ``guest`` in its process; spawned once
    for the module (each spawn starts a process that imports torch)."""
    cls = _recorder_class()
    group = ray_executor.spawn("recorder", cls, [(), ()])
    guest = ray_executor.spawn_hosted("guest", cls, [()], ray_executor.spawn("host", cls, [()]))
    yield group.handles[0], group.handles[1], guest.handles[0]
    for handle in [*group.handles, guest.handles[0].host]:
        ray_executor.stop(handle)


@pytest.fixture
def recorders(ray_executor, spawned_recorders):
    """The module's recorders, each with an empty log."""
    first, second, guest = spawned_recorders
    ray_executor.get([ray_executor.invoke(h, "forget", (), {}) for h in (first, second, guest, guest.host)])
    return spawned_recorders


@pytest.mark.ray
def test_calls_in_one_block_reach_each_worker_as_one_task_and_run_in_order(ray_executor, recorders):
    ex = ray_executor
    first, second, guest = recorders
    with ex.one_task_per_worker():
        a = ex.invoke(first, "add", (1,), {})
        b = ex.invoke(second, "add", (2,), {})
        c = ex.invoke(first, "add", (3,), {})
        d = ex.invoke(guest, "add", (4,), {})
        e = ex.invoke(guest.host, "add", (5,), {})  # the host's own call, after its guest's
    (x1, t1), (x2, t2), (x3, t3), (x4, t4), (x5, t5) = ex.get([a, b, c, d, e])
    assert (x1, x2, x3, x4, x5) == (1, 2, 3, 4, 5)
    assert t1 == t3 and t4 == t5  # one task per worker process, the hosted worker's included
    assert len({t1, t2, t4}) == 3
    assert ex.get(ex.invoke(first, "seen", (), {})) == [1, 3]
    assert ex.get(ex.invoke(guest.host, "seen", (), {})) == [5]
    assert ex.get(ex.invoke(guest, "seen", (), {})) == [4]
    # wait and cancel take the block's futures like any other
    assert ex.wait([b, d]) in ([0], [1], [0, 1])  # both done: at least one reported
    ex.cancel([a])  # finished: nothing to cancel, and no error


@pytest.mark.ray
def test_a_lone_call_in_a_block_is_an_ordinary_call(ray_executor, recorders):
    ex = ray_executor
    first, *_ = recorders
    with ex.one_task_per_worker():
        lone = ex.invoke(first, "add", (1,), {})
    outside = ex.invoke(first, "add", (2,), {})
    assert ex.get(lone)[1] != ex.get(outside)[1]
    assert ex.call_seconds(lone) is None  # sent alone, the driver times it itself
    assert ex.call_seconds(outside) is None


@pytest.mark.ray
def test_the_worker_times_each_call_of_a_task(ray_executor, recorders):
    ex = ray_executor
    first, *_ = recorders
    with ex.one_task_per_worker():
        slow = ex.invoke(first, "add", ("slow", 0.3), {})
        fast = ex.invoke(first, "add", ("fast",), {})
    ex.get([slow, fast])
    assert 0.3 <= ex.call_seconds(slow) < 1.5
    assert 0 <= ex.call_seconds(fast) < 0.1


@pytest.mark.ray
def test_a_failing_call_ends_its_task_and_is_every_calls_result(ray_executor, recorders):
    ex = ray_executor
    first, second, _ = recorders
    with ex.one_task_per_worker():
        before = ex.invoke(first, "add", (1,), {})
        failing = ex.invoke(first, "fail", ("update diverged",), {})
        after = ex.invoke(first, "add", (2,), {})
        elsewhere = ex.invoke(second, "add", (3,), {})
    for future in (before, failing, after):
        with pytest.raises(RollError, match="update diverged"):
            ex.get(future)
    assert ex.get(ex.invoke(first, "seen", (), {})) == [1]  # the call after the failing one never ran
    assert ex.get(elsewhere)[0] == 3  # another worker's task is its own


@pytest.mark.ray
def test_results_are_read_after_the_block_and_a_block_that_raises_sends_nothing(ray_executor, recorders):
    ex = ray_executor
    first, *_ = recorders
    with ex.one_task_per_worker():
        early = ex.invoke(first, "add", (1,), {})
        with pytest.raises(RollError, match="before the one_task_per_worker block"):
            ex.get(early)
        with ex.one_task_per_worker():  # nested: the outer block sends
            inner = ex.invoke(first, "add", (2,), {})
        with pytest.raises(RollError, match="before the one_task_per_worker block"):
            ex.wait([inner])
    assert ex.get(early)[1] == ex.get(inner)[1]

    with pytest.raises(ValueError, match="the driver failed"):
        with ex.one_task_per_worker():
            lost = ex.invoke(first, "add", (3,), {})
            raise ValueError("the driver failed")
    with pytest.raises(RollError, match="never sent"):
        ex.get(lost)
    assert ex.get(ex.invoke(first, "seen", (), {})) == [1, 2]


def test_local_calls_run_at_once_inside_a_block():
    ex = LocalExecutor()
    worker = _recorder_class()()
    with ex.one_task_per_worker():
        assert ex.get(ex.invoke(worker, "add", (1,), {}))[0] == 1
        assert worker.seen() == [1]
    assert ex.call_seconds(ex.invoke(worker, "add", (2,), {})) is None


def test_run_calls_runs_in_order_and_reports_seconds_last():
    worker = _recorder_class()()
    worker.host("guest", _recorder_class(), ())
    *results, seconds = worker.run_calls((None, "add", (1,), {}), ("guest", "add", (2,), {"seconds": 0.05}),
                                         (None, "seen", (), {}))
    assert [r[0] for r in results[:2]] == [1, 2] and results[2] == [1]
    assert worker.hosted["guest"].seen() == [2]
    assert len(seconds) == 3 and seconds[1] >= 0.05 > seconds[0]


@pytest.mark.ray
def test_reward_workers_take_one_thread_where_no_model_computes_and_leave_the_count_where_one_does(ray_executor):
    """A reward worker of a Ray run (in its own process, or in the driver) computes on one thread
    (its own process loads torch only where a reward needs it);
    one built where the models compute (the local executor's one process, also the controller's
    inside a Ray worker) keeps the thread count their roles set: a replacement for a hung reward,
    built mid-run, would otherwise slow every later step."""
    import torch

    from roll_core.config import load_config
    from roll_core.pipelines.runtime import RoleGroups
    from roll_core.plugins import get_plugins

    def reward_group(executor, placement):
        config = load_config(None, [f"executor={executor.name}", f"roles.reward.placement={placement}"])
        groups = RoleGroups(config, executor, get_plugins())
        groups.rewards()
        return groups.groups["reward"]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        own = reward_group(ray_executor, "workers")
        # exact_match needs no torch, so its worker's process never loaded it (it starts seconds sooner)
        (pid,) = ray_executor.get(own.call("pid"))
        assert "libtorch" not in (Path("/proc") / str(pid) / "maps").read_text()
        # a reward that loads torch (here, the thread count's own query) gets one thread all the same
        assert ray_executor.get(own.call("threads")) == [1] and torch.get_num_threads() == 2
        for handle in own.handles:
            ray_executor.stop(handle)
        for placement in ["workers", "driver"]:
            assert isinstance(reward_group(LocalExecutor(), placement).executor, LocalExecutor)
            assert torch.get_num_threads() == 2, placement
        assert isinstance(reward_group(ray_executor, "driver").executor, LocalExecutor)  # in the driver
        assert torch.get_num_threads() == 1  # as before: the driver of a Ray run computes no model
    finally:
        torch.set_num_threads(before)


def test_a_reward_worker_without_torch_leaves_one_thread_to_the_torch_a_reward_loads_later():
    """Where no model computes, a reward worker whose process has no torch yet (a Ray worker of its
    own: the reward worker's module imports none) sets OpenMP's thread count, which torch reads when
    a reward first loads it, even where the user's environment asked for more."""
    code = ("import sys\n"
            "from roll_core.config import load_config\n"
            "from roll_core.runtime.reward_worker import RewardWorker\n"
            "RewardWorker([('exact_match', {}, 1.0)], load_config(None, []))\n"
            "assert 'torch' not in sys.modules\n"
            "import torch\n"
            "print(torch.get_num_threads())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1"]


def test_the_local_executor_closes_its_workers_and_their_strategies_when_it_stops():
    """The local executor's workers live in the driver, which may start another run: stopping one
    (a replaced worker, a restart, the run's end) closes its strategy, which frees what collection
    alone would not (an engine's thread and memory: roll-vllm's test measures that); hosted
    workers close with their host, the last spawned first, and a failing close does not keep the
    others open."""
    from roll_core.runtime.workers import _StrategyWorker
    from roll_core.strategy import Colocatable

    closed: list[str] = []

    class Engine(Colocatable):
        def __init__(self, name):
            self.name = name

        def close(self):
            closed.append(self.name)
            if self.name == "broken":
                raise RuntimeError("engine gone")

    class Holder(_StrategyWorker):
        def __init__(self, name):
            self.role, self.strategy = name, Engine(name)

    ex = LocalExecutor()
    trainers = ex.spawn("actor_train", Holder, [("train-0",), ("train-1",)])
    ex.spawn_hosted("actor_infer", Holder, [("infer-0",), ("infer-1",)], trainers)
    rewards = ex.spawn("reward", _recorder_class(), [()])  # a worker without a strategy
    ex.spawn("reference", Holder, [("broken",)])
    ex.stop(trainers.handles[1])  # as after a replace(): closed once, and not again at shutdown
    assert closed == ["infer-1", "train-1"]
    with pytest.raises(RollError, match="train-1: this worker was closed when its executor stopped it .*'model'"):
        trainers.handles[1].strategy.model  # what a caller that outlived the run would read
    with pytest.warns(RuntimeWarning, match="closing a Holder failed: RuntimeError: engine gone"):
        ex.shutdown()
    assert closed == ["infer-1", "train-1", "broken", "infer-0", "train-0"]
    assert rewards.handles[0].seen() == []
    ex.shutdown()  # nothing is left to close
    assert len(closed) == 5


def _ended(handle, within: float) -> bool:
    """Whether a Ray actor's process ends within ``within`` seconds. ``ray.kill`` returns before
    the kill lands (it goes through Ray's control store), so a call made at once may still be
    served by the live process (it happened in CI): ask until a call fails for the actor's death."""
    import time

    import ray

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=max(deadline - time.monotonic(), 0.1))
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            return False
        time.sleep(0.2)
    return False


@pytest.mark.ray
def test_the_ray_executor_asks_its_workers_to_close_before_it_ends_their_processes(ray_executor, tmp_path):
    """A Ray worker's process ends with the run, but not what it started outside itself (an
    environment's container or simulator): shutdown calls each worker's ``close`` first, waits a
    bounded time, reports a close that failed or did not return, and ends the processes anyway."""
    import time

    import ray

    from roll_core.runtime.executor import RayExecutor

    executor = RayExecutor()  # Ray is already up (the module's executor): this one ends only its own workers
    closing, plain = _closing_classes()
    workers = executor.spawn("env", closing, [(tmp_path / "a",), (tmp_path / "slow", 60.0), (tmp_path / "b", 0, True)])
    others = executor.spawn("plain", plain, [()])
    assert executor.get(others.call("ping")) == ["pong"]
    lost = executor.spawn("lost", closing, [(tmp_path / "lost",)]).handles[0]
    ray.kill(lost)  # a worker already gone (before a restart): nothing to close, nothing to report
    assert _ended(lost, within=30)  # gone before the shutdown asks it to close, not on its way out
    start = time.perf_counter()
    with pytest.warns(RuntimeWarning) as warned:
        executor.shutdown(close_within=4)  # as after Ctrl-C (shorter than the default, close_timeout_s)
    assert time.perf_counter() - start < 4 + 10  # the deadline, not the slow close's minute
    assert sorted(str(w.message) for w in warned) == [
        "1 worker(s) did not close within 4 s (busy or hung); their processes are ended without it",
        "closing a worker failed: OSError: the container would not stop"]
    assert (tmp_path / "a").read_text() == "closed" and not (tmp_path / "slow").exists()
    assert not (tmp_path / "lost").exists()
    for handle in [*workers.handles, *others.handles]:
        assert _ended(handle, within=30)
    assert ray.is_initialized() and ray_executor.get(ray_executor.invoke(
        ray_executor.spawn("after", plain, [()]).handles[0], "ping", (), {})) == "pong"  # the cluster is not this one's


def test_model_roles_spawn_every_role_before_any_is_set_up(tiny_model_path, monkeypatch, capsys):
    """A Ray worker starts when it is spawned, and most of its start is importing torch and
    transformers (about 7 s a role on 2 cores): roles built together (actor_train and actor_infer,
    a student and its teacher, the reference and the critic) are all spawned before any is set up, so
    their processes start side by side. Seeds and data-parallel ranks are each role's own, as
    :meth:`model_role` gives them."""
    from roll_core.config import load_config
    from roll_core.pipelines.runtime import RoleGroups
    from roll_core.plugins import get_plugins

    events = []

    class Recording(LocalExecutor):
        def spawn(self, role, *args, **kwargs):
            events.append(f"spawn {role}")
            return super().spawn(role, *args, **kwargs)

        def invoke(self, handle, method, args, kwargs):
            events.append(f"{method} {handle.role}")
            return super().invoke(handle, method, args, kwargs)

    config = load_config(None, ["executor=local", "roles.actor_infer.num_workers=2", "roles.critic={}",
                                "algorithm.advantage_estimator=gae"])
    roles = RoleGroups(config, Recording(), get_plugins())
    train, infer = roles.model_roles(("actor_train", str(tiny_model_path)), ("actor_infer", str(tiny_model_path)))
    assert events == ["spawn actor_train", "spawn actor_infer", "setup actor_train", "setup actor_infer",
                      "setup actor_infer"]
    assert capsys.readouterr().out == ""  # started within runtime.START_REPORT_S: no line
    events.clear()  # the roles that start from the policy RL begins with: side by side too
    monkeypatch.setattr("roll_core.pipelines.runtime.START_REPORT_S", 0.01)  # a start long enough to report
    reference, critic = roles.policy_copies(train, str(tiny_model_path), True, config.roles.critic)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("starting reference (1 worker) and critic (1 worker): ") and "so far" in printed[0]
    assert printed[-1].startswith("starting reference (1 worker) and critic (1 worker): done in ")
    assert events == ["spawn reference", "spawn critic", "setup reference", "setup critic"]
    assert (reference.role, critic.role) == ("reference", "critic") and critic.handles[0].kind == "critic"
    assert roles.groups == {"actor_train": train, "actor_infer": infer, "reference": reference, "critic": critic}
    seeds = [w._args[3] for w in train.handles + infer.handles]
    assert seeds == [config.seed, config.seed + 1000, config.seed + 1001]
    assert [w._args[3] for w in reference.handles + critic.handles] == [config.seed + 2000, config.seed + 3000]
    assert train.dp_ranks == [0] and infer.dp_ranks == [0, 1]  # inference workers: one replica each
    assert all(w.strategy is not None for w in train.handles + infer.handles)
