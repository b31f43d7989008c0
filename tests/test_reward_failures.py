"""Rewards that misbehave as a plugin author's bug would make them, a changed config resumed into an
old run, and Ctrl-C: each ends in a clear message or a counted policy, never a hang or a traceback.

Unit tests drive the reward worker and router in-process; the integration tests run ``roll run``
with rewards from a fake installed distribution, on the Ray executor (the default) where a worker's
failure or hang is what they check, so the registration reaches the Ray workers through entry points
as a real plugin's would, and on the local one where the executor plays no part (it is faster).
"""

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from conftest import metrics_of, proc_cmdline

from roll_core.config.resume import check_resume, meaningful_changes
from roll_core.errors import ConfigError, RollError
from roll_core.rewards import Reward, RewardInput
from roll_core.rollout.rewards import RewardRouter
from roll_core.runtime import LocalExecutor
from roll_core.runtime.reward_worker import RewardConfigError, RewardError, RewardWorker
from roll_core.testing import hooks

SAMPLES = [RewardInput("p", "r", "r"), RewardInput("p", "x", "r")]


class NaNReward(Reward):
    def score(self, sample):
        return float("nan") if sample.response == "x" else 1.0


class Hanging(Reward):
    def score(self, sample):
        time.sleep(3600)
        return 1.0


class Picky(Reward):
    def __init__(self, penalty: float = 0.0):
        if penalty < 0:
            raise ValueError(f"penalty must be >= 0, got {penalty}")

    def score(self, sample):
        return 1.0


class Counting(Reward):
    """Counts its calls, as an LLM judge counts retries and unparsable verdicts."""

    def __init__(self):
        self.calls = self.reported = 0

    def score(self, sample):
        self.calls += 1
        return 1.0

    def metrics(self):
        out, self.reported = {"calls": float(self.calls - self.reported)}, self.calls
        return out


class Crashing(Reward):
    def score(self, sample):
        raise ZeroDivisionError("my bug")


class Short(Reward):
    """Drops the last sample's score, as a batched reward with an off-by-one would."""

    def score(self, sample):
        return 1.0

    def score_batch(self, samples):
        return [1.0] * (len(samples) - 1)


class Holding(Reward):
    """Holds something outside its memory (a verifier pool, a container): records its close."""

    closed: list = []

    def __init__(self, tag: str = "", fail_close: bool = False):
        self.tag, self.fail_close = tag, fail_close

    def score(self, sample):
        return 1.0

    def close(self):
        Holding.closed.append(self.tag)
        if self.fail_close:
            raise OSError(f"{self.tag}: the pool would not stop")


@pytest.fixture
def rewards(roll_plugins):
    def register(register):
        register("nan_reward", NaNReward)
        register("nan_again", NaNReward)
        register("hanging", Hanging)
        register("hanging_again", Hanging)
        register("picky", Picky)
        register("counting", Counting)
        register("crashing", Crashing)
        register("short", Short)
        register("holding", Holding)

    roll_plugins(("mine", hooks(roll_register_rewards=register)))


def test_a_nan_score_is_an_error_naming_the_reward_and_the_policy_to_change(rewards):
    worker = RewardWorker([("nan_reward", {}, 1.0)], None)
    with pytest.raises(RewardError, match=r"reward 'nan_reward' \(plugin 'mine'\) returned a non-finite score "
                                          r"\(nan\) for 1 of 2 sample\(s\).*roles.reward.on_nonfinite: zero"):
        worker.score_detailed(SAMPLES)


def test_the_zero_policy_scores_nan_zero_and_counts_it(rewards):
    worker = RewardWorker([("nan_reward", {}, 1.0)], None, failures={"on_nonfinite": "zero"})
    out = worker.score_detailed(SAMPLES)
    assert out["scores"] == [1.0, 0.0] and out["nonfinite"] == 1 and not out["replace"]


def test_a_hanging_reward_times_out_per_call_and_asks_for_a_new_worker(rewards):
    worker = RewardWorker([("hanging", {}, 1.0)], None, failures={"timeout_s": 0.1})
    start = time.monotonic()
    out = worker.score_detailed(SAMPLES)
    assert time.monotonic() - start < 1.0  # 2 samples x 0.1 s, not an hour
    assert out["scores"] == [0.0, 0.0] and out["timeouts"] == 2 and out["replace"]
    strict = RewardWorker([("hanging", {}, 1.0)], None, "roles.domain_rewards.code",
                          {"timeout_s": 0.05, "on_timeout": "error"})
    with pytest.raises(RewardError, match=r"reward 'hanging' \(plugin 'mine'\) did not score 2 sample\(s\) within "
                                          r"0.1 s \(roles.domain_rewards.code.timeout_s=0.05 per sample"):
        strict.score_detailed(SAMPLES)


def test_failures_of_several_rewards_in_one_worker_add_up(rewards):
    zero = {"on_nonfinite": "zero", "timeout_s": 0.05}
    out = RewardWorker([("nan_reward", {}, 1.0), ("nan_again", {}, 1.0)], None, failures=zero).score_detailed(SAMPLES)
    assert out["nonfinite"] == 2 and out["scores"] == [2.0, 0.0]
    out = RewardWorker([("hanging", {}, 1.0), ("hanging_again", {}, 1.0)], None, failures=zero).score_detailed(SAMPLES)
    assert out["timeouts"] == 4 and out["replace"]
    # the abandoned calls' threads are named after their rewards (what a stack dump shows)
    assert {"reward-hanging", "reward-hanging_again"} <= {t.name for t in threading.enumerate()}


def test_every_reward_of_a_worker_is_built_and_scores(rewards):
    worker = RewardWorker([("counting", {}, 0.5), ("nan_reward", {}, 2.0)], None)
    assert worker.ready() is True
    out = worker.score_detailed(SAMPLES[:1])
    assert out["scores"] == [2.5] and out["components"] == {"counting": [1.0], "nan_reward": [1.0]}


def test_the_first_reward_that_fails_to_start_is_the_one_reported(rewards):
    worker = RewardWorker([("picky", {"penalty": -1}, 1.0), ("picky", {"penalty": -2}, 1.0)], None)
    with pytest.raises(RewardConfigError, match=r"reward 'picky' .* ValueError: penalty must be >= 0, got -1$"):
        worker.ready()


def test_a_reward_that_raises_or_miscounts_is_named_with_its_plugin(rewards):
    with pytest.raises(RewardError, match=r"^reward 'crashing' \(plugin 'mine'\) raised ZeroDivisionError: my bug$"):
        RewardWorker([("crashing", {}, 1.0)], None).score_detailed(SAMPLES)
    with pytest.raises(RewardError, match=r"^reward 'short' \(plugin 'mine'\) returned 1 scores for 2 samples$"):
        RewardWorker([("short", {}, 1.0)], None).score_detailed(SAMPLES)


def test_the_router_replaces_a_worker_whose_call_hung_and_counts_it(rewards):
    executor = LocalExecutor()
    group = executor.spawn("reward", RewardWorker, [([("hanging", {}, 1.0)], None, "roles.reward", {"timeout_s": 0.05})])
    router = RewardRouter(group)
    first = group.handles[0]
    scores, _, _ = router.gather(router.submit(SAMPLES))
    assert scores == [0.0, 0.0] and group.handles[0] is not first  # a fresh worker took its place
    assert router.pop_failures() == {"reward/timeouts": 2.0, "reward/nonfinite": 0.0, "reward/replaced_workers": 1.0}
    assert router.pop_failures()["reward/timeouts"] == 0.0  # counts are per step


def test_a_rewards_own_counters_are_step_metrics_summed_over_its_workers(rewards):
    executor = LocalExecutor()
    group = executor.spawn("reward", RewardWorker, [([("counting", {}, 1.0)], None)] * 2)
    router = RewardRouter(group)
    router.gather(router.submit(SAMPLES * 3))  # 6 samples over 2 workers
    assert router.pop_failures()["reward/counting/calls"] == 6.0
    router.gather(router.submit(SAMPLES))
    assert router.pop_failures()["reward/counting/calls"] == 2.0  # since the last step only


def test_a_replaced_worker_is_stopped_only_after_the_calls_queued_on_it(rewards):
    executor = LocalExecutor()
    stopped = []
    executor.stop = stopped.append
    group = executor.spawn("reward", RewardWorker, [([("hanging", {}, 1.0)], None, "roles.reward", {"timeout_s": 0.05})])
    router = RewardRouter(group)
    old = group.handles[0]
    first, second = router.submit(SAMPLES), router.submit(SAMPLES)  # both on the one worker
    router.gather(first)
    assert group.handles[0] is not old and stopped == []  # new calls go to the fresh one; the old still owes one
    router.gather(second)
    assert stopped == [old]  # replaced once, stopped once its last call was gathered
    assert router.pop_failures()["reward/replaced_workers"] == 1.0


def test_a_constructor_that_rejects_its_options_is_reported_by_ready_not_by_a_dead_worker(rewards):
    worker = RewardWorker([("picky", {"penalty": -1}, 1.0)], None)  # constructing the worker itself succeeds
    with pytest.raises(RewardConfigError, match=r"key 'roles.reward': reward 'picky' \(plugin 'mine'\) failed to start "
                                                r"with options \{'penalty': -1\}: ValueError: penalty must be >= 0, got -1"):
        worker.ready()
    with pytest.raises(RewardConfigError):
        worker.score_detailed(SAMPLES)


def test_closing_a_worker_closes_each_reward_once_and_names_one_that_fails(rewards):
    Holding.closed = []
    worker = RewardWorker([("holding", {"tag": "a"}, 1.0), ("holding", {"tag": "b", "fail_close": True}, 1.0),
                           ("holding", {"tag": "c"}, 1.0)], None)
    worker.score_detailed(SAMPLES)
    with pytest.raises(RewardError, match=r"^reward 'holding' \(plugin 'mine'\) failed to close: OSError: b: the pool "
                                          r"would not stop$"):
        worker.close()
    assert Holding.closed == ["a", "b", "c"]  # the failure did not keep c open
    worker.close()
    assert Holding.closed == ["a", "b", "c"]  # once
    with pytest.raises(RollError, match=r"^the reward worker of 'roles.reward' is closed: "):
        worker.score_detailed(SAMPLES)  # not an AttributeError of a released reward
    # a constructor that failed: the rewards built before it are closed, the failed one is skipped
    broken = RewardWorker([("holding", {"tag": "d"}, 1.0), ("picky", {"penalty": -1}, 1.0)], None)
    broken.close()
    assert Holding.closed[-1] == "d"


@pytest.mark.parametrize("placement", ["driver", "workers"])
def test_a_run_closes_its_rewards_wherever_they_score(rewards, tiny_config, placement):
    """In the driver (``placement: driver``) the run's end closes them; in reward workers the
    executor's shutdown does (the launcher's job; on Ray, before their processes end)."""
    from roll_core.pipelines.rlvr import RLVRPipeline

    Holding.closed = []
    cfg = tiny_config("warmup.steps=0", "trainer.max_steps=1", "rollout.max_new_tokens=2", "roles.reward.name=holding",
                      f"roles.reward.options={{tag: {placement}}}", f"roles.reward.placement={placement}")
    executor = LocalExecutor()
    RLVRPipeline(cfg, executor).run()
    assert Holding.closed == (["driver"] if placement == "driver" else [])
    executor.shutdown()
    assert Holding.closed == [placement]


def test_which_config_changes_resume_and_which_are_refused(tmp_path):
    from roll_core.config import load_config

    base = load_config(None, [f"output_dir={tmp_path}"]).model_dump(mode="json")

    def changes(*overrides):
        return [k for k, _, _ in meaningful_changes(base, load_config(None, [f"output_dir={tmp_path}", *overrides])
                                                     .model_dump(mode="json"))]

    assert changes("trainer.max_steps=400", "executor=local", "torch_threads=1", "roles.reward.num_workers=3",
                   "trackers=[jsonl]", "roles.reward.timeout_s=5", "runtime.max_restarts=0") == []
    assert changes("roles.reward.name=code") == ["roles.reward.name"]
    assert changes("algorithm.advantage_estimator=rloo", "rollout.temperature=0.7", "seed=1") == [
        "algorithm.advantage_estimator", "rollout.temperature", "seed"]
    current = load_config(None, [f"output_dir={tmp_path}", "roles.reward.name=code"]).model_dump(mode="json")
    with pytest.raises(ConfigError, match=r"roles.reward.name: 'exact_match' -> 'code'.*new output_dir.*"
                                          r"trainer.resume=never"):
        check_resume(base, current, tmp_path / "step_000002")
    check_resume(None, current, tmp_path)  # a checkpoint from before configs were recorded


# ------------------------------------------------------------------------------------------------
# On the Ray executor, through `roll run`
# ------------------------------------------------------------------------------------------------
PLUGIN = '''
import os, time
from roll_core import hookimpl
from roll_core.rewards import Reward

class NaNReward(Reward):
    def score(self, sample):
        return float("nan")

class Hanging(Reward):
    def score(self, sample):
        marker = os.environ.get("ROLL_TEST_MARKER")
        if marker:
            open(marker, "w").write(str(os.getpid()))
        time.sleep(3600)
        return 1.0

class Picky(Reward):
    def __init__(self, penalty: float = 0.0):
        if penalty < 0:
            raise ValueError(f"penalty must be >= 0, got {penalty}")
        self.penalty = penalty

    def score(self, sample):
        return 1.0

@hookimpl
def roll_register_rewards(register):
    register("nan_reward", NaNReward)
    register("hanging", Hanging)
    register("picky", Picky)
'''

FAST = ["warmup.steps=0", "rollout.prompts_per_step=4", "rollout.num_return_sequences=2", "trainer.eval_every=0",
        "data.eval_size=4", "trackers=[jsonl]", "torch_threads=1", "executor=ray"]


@pytest.fixture
def roll(fake_dist, tmp_path):
    site = fake_dist("roll-misbehaving-rewards", "misbehaving_rewards", PLUGIN)
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
           "ROLL_TEST_TAG": tag}

    def run(run_dir, *overrides, timeout=300):
        return subprocess.run([sys.executable, "-m", "roll_core.cli", "run", f"output_dir={run_dir}", *FAST, *overrides],
                              capture_output=True, text=True, env=env, timeout=timeout)

    run.env, run.tag = env, tag
    return run


def _cmdline(pid: int) -> str:
    return (proc_cmdline(pid) or "(exited)")[:200]


def _processes_tagged(tag: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"ROLL_TEST_TAG={tag}".encode() in open(f"/proc/{pid}/environ", "rb").read():
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.ray
def test_ray_nan_reward_stops_with_one_line_or_scores_zero_by_policy(roll, tmp_path):
    out = roll(tmp_path / "strict", "roles.reward.name=nan_reward", "trainer.max_steps=2")
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "reward 'nan_reward' (plugin 'misbehaving_rewards') returned a non-finite score (nan)" \
        in errors[0] and "roles.reward.on_nonfinite: zero" in errors[0]
    assert "Traceback" not in out.stderr

    # the policy is applied in the reward worker, the same code on either executor
    out = roll(tmp_path / "zero", "roles.reward.name=nan_reward", "roles.reward.on_nonfinite=zero", "trainer.max_steps=2",
               "executor=local")
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [r for r in metrics_of(tmp_path / "zero") if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["reward/nonfinite"] >= 8 and r["reward/mean"] == 0.0 for r in steps)  # 8 samples a step


@pytest.mark.ray
def test_ray_hanging_reward_is_timed_out_per_call_and_the_run_finishes(roll, tmp_path):
    start = time.monotonic()
    # request_size 2: four calls a step queue on the one reward worker behind the one that hangs
    out = roll(tmp_path / "run", "roles.reward.name=hanging", "roles.reward.timeout_s=0.25", "trainer.max_steps=2",
               "rollout.request_size=2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert time.monotonic() - start < 240
    steps = [r for r in metrics_of(tmp_path / "run") if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # every sample of the step timed out and scored 0; the hung worker was replaced
        assert r["reward/timeouts"] == 8 and r["reward/mean"] == 0.0 and r["reward/replaced_workers"] >= 1
    assert "restart" not in out.stdout.lower()  # replaced in place, the run itself never restarted


@pytest.mark.ray
def test_ray_rejected_reward_options_fail_in_seconds_before_the_warm_up(roll, tmp_path):
    start = time.monotonic()
    out = roll(tmp_path / "run", "roles.reward.name=picky", "roles.reward.options.penalty=-1", "warmup.steps=200")
    elapsed = time.monotonic() - start
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    # -1 arrives as -1.0: `roll validate` coerced it to the constructor's declared float
    assert errors == ["error: key 'roles.reward': reward 'picky' (plugin 'misbehaving_rewards') failed to start with "
                      "options {'penalty': -1.0}: ValueError: penalty must be >= 0, got -1.0"], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "\x1b[" not in out.stderr  # no raw worker log, no colour escapes
    assert "warm-up" not in out.stdout and "Restarting" not in out.stdout
    assert elapsed < 60, elapsed  # Ray's start-up, then at once (the warm-up alone takes minutes)


def test_resuming_a_changed_reward_into_an_old_run_is_refused(roll, tmp_path):
    run_dir = tmp_path / "run"
    local = "executor=local"  # the check reads the run's config.json before any worker starts, on any executor
    assert roll(run_dir, "trainer.max_steps=2", local).returncode == 0
    config_before = (run_dir / "config.json").read_text()
    out = roll(run_dir, "roles.reward.name=picky", "trainer.max_steps=3", local)
    assert out.returncode == 2
    assert "roles.reward.name: 'exact_match' -> 'picky'" in out.stderr and "trainer.resume=never" in out.stderr
    assert (run_dir / "config.json").read_text() == config_before  # nothing of the old run is touched
    more = roll(run_dir, "trainer.max_steps=3", local)  # more steps of the same run do resume
    assert more.returncode == 0 and "resumed from" in more.stdout, more.stderr[-2000:]
    assert [r["step"] for r in metrics_of(run_dir)][-1] == 3


@pytest.mark.ray
def test_ray_ctrl_c_on_a_run_blocked_on_a_hung_reward_prints_one_line_and_leaves_nothing(roll, tmp_path):
    marker = tmp_path / "reward-called"
    env = {**roll.env, "ROLL_TEST_MARKER": str(marker)}
    cmd = [sys.executable, "-m", "roll_core.cli", "run", f"output_dir={tmp_path / 'run'}", *FAST,
           "roles.reward.name=hanging", "roles.reward.timeout_s=600"]
    # The run as a terminal's foreground job gets Ctrl-C. Where pytest itself runs as a background
    # job of a shell without job control, it inherits SIGINT ignored and so would the child, which
    # then never sees the signal; the child starts with the default disposition instead.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    if not marker.exists():
        proc.kill()
        pytest.fail(f"the reward was never called:\n{proc.communicate()[1][-3000:]}")
    time.sleep(1.0)  # the driver is now blocked waiting for the reward worker
    proc.send_signal(signal.SIGINT)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()  # no hung run left behind for the rest of the suite
        pytest.fail(f"the run did not stop within 60 s of SIGINT:\n{proc.communicate()[1][-3000:]}")
    assert proc.returncode == 130, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert lines[-1].startswith("interrupted during held-out evaluation; every worker was stopped."), stderr[-3000:]
    assert "roll run output_dir=" in lines[-1] and "resumes from" in lines[-1], stderr[-3000:]
    # Ray's raylet and GCS exit on their own after the driver's shutdown; slower on a loaded machine
    deadline = time.monotonic() + 60
    while _processes_tagged(roll.tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {pid: _cmdline(pid) for pid in _processes_tagged(roll.tag)}
    assert left == {}, f"left behind: {left}\n{stderr[-3000:]}"  # no Ray worker, raylet or sandbox
