"""The controller inside the worker (``ray.colocate_controller``, :mod:`roll_core.runtime.controller`):
which layouts qualify; what the host process streams back (in this process, on a scripted pipeline:
output, phases, the summary, an error); and ``roll run`` on Ray running the quickstart's pipeline
inside its one worker with the local executor's numbers, its output, its errors, a restart after the
worker dies and Ctrl-C."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import metrics_of

from roll_core.config import load_config
from roll_core.errors import ConfigError
from roll_core.runtime.executor import _worker_env
from roll_core.runtime.placement import controller_blocker, controller_in_worker

RAY = ["executor=ray"]


def test_the_quickstart_layout_runs_its_controller_in_its_one_worker():
    cfg = load_config(None, RAY)
    assert controller_blocker(cfg) is None and controller_in_worker(cfg)
    assert _worker_env(cfg) == {}  # the split run's shorter OpenMP spin is not for one process
    assert not controller_in_worker(load_config(None, RAY + ["ray.colocate_controller=false"]))
    assert not controller_in_worker(load_config(None, ["executor=local"]))


@pytest.mark.parametrize("overrides, reason", [
    (["algorithm.kl_metric=true"], "roles.reference runs on workers of its own"),
    (["algorithm.kl_loss_coef=0.1"], "roles.reference runs on workers of its own"),
    (["pipeline=online_dpo"], "roles.reference runs on workers of its own"),
    (["pipeline=dpo", "dpo.loss=ipo"], "roles.reference runs on workers of its own"),
    (["pipeline=distill"], "roles.reference runs on workers of its own"),  # the teacher
    (["algorithm.advantage_estimator=gae", "roles.critic={}"], "roles.critic runs on workers of its own"),
    (["roles.teacher={kind: infer}"], "roles.teacher runs on workers of its own"),
    (["roles.reward.placement=workers"], "roles.reward scores on workers of its own (its placement)"),
    (["ray.hybrid_engine=false"], "actor_infer runs in a process of its own (ray.hybrid_engine: false)"),
    (["roles.actor_infer.num_workers=2"], "actor_infer runs in a process of its own: the hybrid engine is off, as it "
                                          "needs roles.actor_train.num_workers and roles.actor_infer.num_workers of 1"),
    (["rollout.scheduler=async"], "actor_infer runs in a process of its own: the hybrid engine is off, as the 'async' "
                                  "scheduler generates while the policy trains"),
    (["roles.actor_train.num_workers=2"], "it needs one CPU worker of actor_train (no device_mapping, num_workers 1)"),
    (["runtime.weight_sync=shared_memory"], "runtime.weight_sync 'shared_memory' moves the weights between processes"),
    (["pipeline=agentic"], "the agentic pipeline's environment workers run in processes of their own"),
])
def test_a_layout_of_more_than_one_process_keeps_its_controller_in_the_driver(overrides, reason):
    cfg = load_config(None, RAY + overrides)
    assert controller_blocker(cfg) == reason
    assert not controller_in_worker(cfg)


def test_the_weights_handed_over_in_the_process_keep_the_controller_in_the_worker():
    assert controller_in_worker(load_config(None, RAY + ["runtime.weight_sync=in_process"]))


def test_a_reference_nothing_reads_does_not_keep_the_controller_out():
    # the reference is configured by default, but with no KL term nor metric it is never started
    cfg = load_config(None, RAY)
    assert cfg.roles.reference is not None and controller_in_worker(cfg)
    # nor does one a reference-free preference loss leaves unread, or reference log-probs in the data
    assert controller_in_worker(load_config(None, RAY + ["pipeline=online_dpo", "dpo.loss=simpo"]))
    assert controller_in_worker(load_config(None, RAY + ["pipeline=dpo", "dpo.reference=precomputed"]))


def test_asking_for_the_controller_in_the_worker_where_it_cannot_be_is_a_config_error():
    with pytest.raises(ConfigError, match=r"ray.colocate_controller: true, but roles.reference runs on workers of "
                                          r"its own; use auto \(on wherever it can be\) or false"):
        load_config(None, RAY + ["ray.colocate_controller=true", "algorithm.kl_metric=true"])
    assert controller_in_worker(load_config(None, RAY + ["ray.colocate_controller=true"]))


# -- the host's side, in this process ------------------------------------------------------------

class _Scripted:
    """A pipeline that prints, moves to its next phase once the test has received that output, and
    returns a summary or raises."""

    seen_output = threading.Event()

    def __init__(self, config, executor):
        self.config, self.executor, self.phase = config, executor, "start-up"

    def run(self):
        print("step 1", end="")
        print(" done")
        sys.stderr.write("warn\n")
        print("step 2")
        assert self.seen_output.wait(10)
        time.sleep(0.2)  # flushes go by in the same phase, which is sent once
        self.phase = "train"
        print("last")
        if self.config.trainer.max_steps == 13:  # the tests' cue for a run that fails
            raise RuntimeError("the pipeline failed")
        return {"steps": 2, "executor": self.config.executor, "tty": sys.stdout.isatty()}


@pytest.fixture
def host(monkeypatch):
    """``run(config)``: the items a :class:`ControllerHost` yields for ``_Scripted`` on ``config``."""
    from roll_core.runtime import controller

    class Pipelines:
        @staticmethod
        def get(name):
            assert name == "rlvr"
            return _Scripted

    monkeypatch.setattr("roll_core.plugins.get_plugins", lambda: type("P", (), {"pipelines": Pipelines})())
    monkeypatch.setattr(controller, "FLUSH_S", 0.05)
    _Scripted.seen_output.clear()

    def run(config, items, tty=False):
        for item in controller.ControllerHost().run(config, tty):
            items.append(item)
            if "step 2" in "".join(t for n, t in items if n == "stdout"):
                _Scripted.seen_output.set()
        return items
    return run


def test_the_host_streams_the_output_and_each_new_phase_then_the_summary(host):
    streams = sys.stdout, sys.stderr
    items = host(load_config(None, RAY), [], tty=True)
    assert (sys.stdout, sys.stderr) == streams  # put back
    # run on the local executor, its output drawn as on the driver's terminal
    assert items.pop() == ("summary", {"steps": 2, "executor": "local", "tty": True})
    text = {name: "".join(t for n, t in items if n == name) for name in ("stdout", "stderr")}
    assert text == {"stdout": "step 1 done\nstep 2\nlast\n", "stderr": "warn\n"}
    phases = [i for i, (n, _) in enumerate(items) if n == "phase"]
    assert [items[i][1] for i in phases] == ["start-up", "train"]
    assert "last" not in "".join(t for n, t in items[:phases[0]] if n == "stdout")  # the first flush's phase


def test_the_host_raises_the_pipelines_error_after_the_output_before_it(host):
    items: list = []
    with pytest.raises(RuntimeError, match="the pipeline failed"):
        host(load_config(None, RAY + ["trainer.max_steps=13"]), items)
    assert "".join(t for n, t in items if n == "stdout").endswith("last\n")
    assert all(n != "summary" for n, _ in items)


def test_consecutive_writes_to_one_stream_travel_as_one():
    from roll_core.runtime.controller import _joined

    chunks = [("stdout", "a"), ("stdout", "b"), ("stderr", "c"), ("stdout", "d"), ("stdout", "e")]
    assert _joined(chunks) == [("stdout", "ab"), ("stderr", "c"), ("stdout", "de")]
    assert _joined([]) == []


# -- roll run -------------------------------------------------------------------------------------

FAST = ["warmup.steps=5", "rollout.prompts_per_step=4", "rollout.num_return_sequences=4", "trainer.eval_every=0",
        "data.eval_size=8", "trackers=[jsonl]", "torch_threads=1"]


def _cli(run_dir, *overrides):
    return [sys.executable, "-m", "roll_core.cli", "run", f"output_dir={run_dir}", *FAST, *overrides]


@pytest.mark.ray
def test_roll_run_on_ray_runs_the_quickstart_inside_its_worker_with_the_local_runs_numbers(tmp_path):
    runs = {}
    for executor in ("local", "ray"):
        run_dir = tmp_path / executor
        proc = subprocess.Popen(_cli(run_dir, f"executor={executor}", "trainer.max_steps=3", "trainer.eval_every=2"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        runs[executor] = (proc.pid, stdout, run_dir)
    pid, stdout, run_dir = runs["ray"]
    assert "executor ray (the controller inside its one worker)" in stdout
    # what the pipeline prints in the worker reaches the driver's stdout, in order
    assert stdout.index("held-out accuracy before RL") < stdout.index("after 3 RL steps")
    placement = json.loads((run_dir / "placement.json").read_text())
    host = placement["driver_pid"]
    assert host != pid and {w["pid"] for ws in placement["roles"].values() for w in ws} == {host}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["controller"] == "worker" and summary["restarts"] == 0
    assert json.loads((run_dir / "config.json").read_text())["executor"] == "local"  # what the pipeline ran on
    local, ray = metrics_of(runs["local"][2]), metrics_of(run_dir)
    assert [m["step"] for m in ray] == [0, 1, 2, 3] == [m["step"] for m in local]
    for a, b in zip(local, ray):
        for key in ("reward/mean", "train/pg_loss", "train/grad_norm", "eval/accuracy"):
            assert a.get(key) == b.get(key), (a["step"], key)  # the same code in another process: equal


@pytest.mark.ray
def test_a_run_error_in_the_worker_is_one_line_as_in_the_driver(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(8)))
    out = subprocess.run(_cli(tmp_path / "run", "executor=ray", f"data.train_file={data}", "trainer.max_steps=2"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "executor ray (the controller inside its one worker)" in out.stdout
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "training rows have no 'ground_truth'" in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr


def _host_pid(run_dir, proc, deadline_s=240):
    """The worker's pid, from the placement the pipeline records once its workers are up."""
    placement = run_dir / "placement.json"
    deadline = time.monotonic() + deadline_s
    while not placement.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert placement.exists(), "the run recorded no placement"
    time.sleep(0.2)  # written whole by now
    return json.loads(placement.read_text())["driver_pid"]


@pytest.mark.ray
@pytest.mark.parametrize("max_restarts", [1, 0])
def test_when_the_worker_dies_the_driver_restarts_it_from_the_last_checkpoint(tmp_path, max_restarts):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_cli(run_dir, "executor=ray", "trainer.max_steps=30", "trainer.save_every=2",
                                 "trainer.keep_checkpoints=1000", f"runtime.max_restarts={max_restarts}"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    host = _host_pid(run_dir, proc)
    checkpoint = run_dir / "checkpoints" / "step_000002" / "state.json"
    deadline = time.monotonic() + 120
    while not checkpoint.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert checkpoint.exists() and proc.poll() is None, "the run ended before its step-2 checkpoint"
    os.kill(host, signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=600)
    if max_restarts == 0:
        assert proc.returncode == 2, stderr[-3000:]
        error = [line for line in stderr.splitlines() if line.startswith("error:")][-1]
        assert "the run's worker process died" in error and "No restarts left (runtime.max_restarts=0)" in error
        assert "run the same command again to resume from the last checkpoint" in error
        return
    assert proc.returncode == 0, stderr[-3000:]
    assert "warning: the run's worker process died" in stdout and "(restart 1 of 1)" in stdout
    assert "resumed from" in stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["controller"] == "worker" and summary["steps"] == 30
    assert json.loads((run_dir / "placement.json").read_text())["driver_pid"] != host  # a fresh process
    assert [m["step"] for m in metrics_of(run_dir)][-1] == 30


@pytest.mark.ray
def test_ctrl_c_stops_the_worker_and_names_the_step_it_stopped_in(tmp_path):
    run_dir = tmp_path / "run"
    # started with the default disposition of SIGINT, as a terminal's foreground job (see test_reward_failures)
    proc = subprocess.Popen(_cli(run_dir, "executor=ray", "trainer.max_steps=2000"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    host = _host_pid(run_dir, proc)
    time.sleep(3.0)  # into the RL steps, and the phase streamed back
    proc.send_signal(signal.SIGINT)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the run did not stop within 60 s of SIGINT:\n{proc.communicate()[1][-3000:]}")
    assert proc.returncode == 130, stderr[-3000:]
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    assert last.startswith("interrupted during RL step ") and "every worker was stopped" in last, stderr[-3000:]
    assert "resumes from the last checkpoint" in last
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{host}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{host}"), "the worker outlived the run"
