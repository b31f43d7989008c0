"""The busy-cores check `roll run` makes before any worker starts (roll_core.runtime.cpu_share)."""

import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import proc_stat

from roll_core.config import load_and_check
from roll_core.errors import RollError
from roll_core.runtime import cpu_share


@pytest.mark.parametrize("threads, busy, cores, fits", [
    (2, 1.0, 2, 1),      # one of two cores taken: one thread fits
    (2, 0.3, 2, None),   # a fraction of a core (an editor) does not count
    (2, 0.6, 2, 1),      # more than half a core does
    (2, 2.0, 2, 1),      # every core taken: still at least one thread
    (1, 1.5, 2, None),   # one thread is as few as it gets
    (4, 1.0, 8, None),   # room to spare
    (8, 3.0, 8, 5),
])
def test_fitting_threads(threads, busy, cores, fits):
    assert cpu_share.fitting_threads(threads, busy, cores) == fits


def test_the_hint_names_the_busy_cores_and_the_largest_thread_count_of_any_role():
    config = load_and_check(None, ["executor=ray", "torch_threads=1", "roles.actor_train.torch_threads=2"])
    hint = cpu_share.cpu_share_hint(config, busy=1.0, cores=2)
    assert "about 1.0 of this machine's 2 cores busy" in hint
    assert "runs 2 torch threads" in hint and hint.endswith("torch_threads=1 fits beside them.")
    assert cpu_share.cpu_share_hint(config, busy=0.2, cores=2) is None
    assert cpu_share.cpu_share_hint(load_and_check(None, ["torch_threads=1"]), busy=1.0, cores=2) is None
    assert cpu_share.cpu_share_hint(config, busy=None) is None  # not measurable: nothing to say


def test_the_hint_counts_one_core_where_the_machine_does_not_say(monkeypatch):
    monkeypatch.setattr(cpu_share.os, "cpu_count", lambda: None)
    hint = cpu_share.cpu_share_hint(load_and_check(None, ["torch_threads=2"]), busy=0.6)
    assert "of this machine's 1 core busy" in hint


def _cores_used(pid: int, measure):
    """``measure()``'s result, and the cores process ``pid`` kept busy meanwhile (its user and system
    clock ticks in /proc/<pid>/stat, fields 14 and 15, over the wall time)."""
    def ticks() -> int:
        fields = proc_stat(pid)
        return int(fields[11]) + int(fields[12])

    start, before = time.monotonic(), ticks()
    result = measure()
    return result, (ticks() - before) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - start)


@pytest.mark.skipif(not cpu_share.STAT.exists(), reason="/proc/stat is Linux's")
def test_busy_cores_sees_a_process_that_keeps_a_core_busy():
    """The spinner's share of the CPU, measured by itself, is counted: compared with it rather than
    with a sample taken before it started, since whatever else runs here (CI runs its nox sessions
    beside this suite) keeps a varying share of the cores busy."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # past the interpreter's start
        busy, spun = _cores_used(spinner.pid, lambda: cpu_share.busy_cores(0.5))
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and spun > 0.3, (busy, spun)  # it ran: alone, a whole core; beside others, a share
    assert spun - 0.15 <= busy <= (os.cpu_count() or 1) + 0.05, (busy, spun)


def test_nothing_is_measured_without_proc_stat(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_share, "STAT", tmp_path / "missing")
    assert cpu_share.busy_cores(0.01) is None


def _stat(user, nice, system, idle, iowait, irq, softirq, steal, guest=0):
    """A /proc/stat: the all-CPU line, then per-CPU lines that must not be read. The kernel counts a
    guest's time in ``user`` as well (and ``guest_nice``'s in ``nice``), so those columns are not added."""
    return (f"cpu  {user} {nice} {system} {idle} {iowait} {irq} {softirq} {steal} {guest} 0\n"
            "cpu0 1 2 3 4 5 6 7 8 0 0\ncpu1 9 9 9 9 9 9 9 9 0 0\nintr 12345\n")


def _sampled(monkeypatch, tmp_path, before: str, after: str | None, cores):
    """busy_cores over a /proc/stat that reads ``before`` and then ``after`` (None: gone)."""
    stat = tmp_path / "stat"
    stat.write_text(before)
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        if after is None:
            stat.unlink()
        else:
            stat.write_text(after)

    monkeypatch.setattr(cpu_share, "STAT", stat)
    monkeypatch.setattr(cpu_share.time, "sleep", sleep)
    monkeypatch.setattr(cpu_share.os, "cpu_count", lambda: cores)
    busy = cpu_share.busy_cores()
    assert slept == [0.1]  # a tenth of a second before the run's workers start
    return busy


def test_busy_cores_counts_all_but_idle_and_iowait_time_from_the_all_cpu_line(monkeypatch, tmp_path):
    before = _stat(100, 5, 50, 1000, 20, 3, 2, 1, guest=10)
    # +100 user, +50 system, +4 irq, +6 softirq, +10 steal busy; +100 idle, +30 iowait not; the
    # guest's +40 is inside user's +100
    after = _stat(200, 5, 100, 1100, 50, 7, 8, 11, guest=50)
    busy = _sampled(monkeypatch, tmp_path, before, after, cores=2)
    assert busy == pytest.approx(2 * 170 / 300)
    assert _sampled(monkeypatch, tmp_path, before, after, cores=None) == pytest.approx(170 / 300)  # unknown: 1


def test_busy_cores_is_none_when_nothing_was_counted_or_the_file_went_away(monkeypatch, tmp_path):
    before = _stat(100, 5, 50, 1000, 20, 3, 2, 1)
    assert _sampled(monkeypatch, tmp_path, before, before, cores=2) is None  # no tick in between
    assert _sampled(monkeypatch, tmp_path, before, None, cores=2) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is about runs on CPU")
def test_roll_run_warns_before_any_worker_starts(monkeypatch, capsys):
    from roll_core import cli, runtime

    monkeypatch.setattr(cpu_share, "busy_cores", lambda: 1.0)
    monkeypatch.setattr(cpu_share.os, "cpu_count", lambda: 2)

    def no_executor(config):
        raise RollError("stopped before the executor")

    monkeypatch.setattr(runtime, "make_executor", no_executor)
    assert cli.main(["run", "torch_threads=2"]) == 2
    out = capsys.readouterr()
    assert "warning: other processes keep about 1.0 of this machine's 2 cores busy" in out.out
    assert "stopped before the executor" in out.err
