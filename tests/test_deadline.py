"""``call_with_deadline`` (:mod:`roll_core.runtime.deadline`): what reward and environment workers
run plugin code through. ``test_reward_failures.py`` covers it inside the workers; this pins the
call itself."""

from __future__ import annotations

import threading

import pytest

from roll_core.runtime.deadline import Hung, call_with_deadline


def test_the_result_of_a_call_that_returns_in_time():
    assert call_with_deadline(lambda: 42, 5.0, "reward") == 42
    assert call_with_deadline(lambda: None, 5.0, "reward") is None


def test_the_calls_own_exception_is_raised_in_the_caller():
    error = ValueError("bad sample")

    def fails():
        raise error

    with pytest.raises(ValueError) as raised:
        call_with_deadline(fails, 5.0, "reward")
    assert raised.value is error


def test_a_call_past_its_deadline_is_abandoned_in_a_named_daemon_thread():
    release = threading.Event()
    seen = {}

    def hangs():
        seen["thread"] = threading.current_thread()
        release.wait(30)
        return "late"

    with pytest.raises(Hung, match=r"^score\[exact\] did not return within 0.05 s$"):
        call_with_deadline(hangs, 0.05, "score[exact]")
    thread = seen["thread"]
    # still running, and a daemon: a hung plugin call does not keep the process from exiting
    assert thread.is_alive() and thread.daemon and thread.name == "score[exact]"
    release.set()
    thread.join(5)
    assert not thread.is_alive()


def test_the_call_runs_outside_the_calling_thread():
    assert call_with_deadline(threading.current_thread, 5.0, "env") is not threading.current_thread()
