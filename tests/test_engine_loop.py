"""The engine loop that lets several threads share one inference engine, on a fake engine with vLLM's four
methods (add_request, step, abort_request, has_unfinished_requests): requests from different calls
run together, a cancelled call is aborted in the engine, a pause waits for running requests and
holds new ones back, and errors reach the caller they belong to."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from roll_core.strategies.engine_loop import EngineLoop


class FakeEngine:
    """A request's params is the number of steps it takes; a prompt "bad" is rejected."""

    def __init__(self, step_s: float = 0.01):
        self.left: dict[str, int] = {}
        self.step_s = step_s
        self.max_together = 0
        self.aborted: list[str] = []
        self.log: list[str] = []

    def add_request(self, rid, prompt, steps):
        if prompt == "bad":
            raise ValueError("prompt too long")
        self.left[rid] = steps
        self.log.append(f"add {prompt}")

    def has_unfinished_requests(self):
        return bool(self.left)

    def step(self):
        time.sleep(self.step_s)
        self.max_together = max(self.max_together, len(self.left))
        done = []
        for rid in list(self.left):
            self.left[rid] -= 1
            if self.left[rid] <= 0:
                del self.left[rid]
                done.append(SimpleNamespace(request_id=rid, finished=True, value=rid))
        return done

    def abort_request(self, rids):
        self.aborted += rids
        for rid in rids:
            self.left.pop(rid, None)


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture
def loop(engine):
    loop = EngineLoop(engine)
    yield loop
    loop.close()


def in_thread(fn):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn()))
    thread.start()
    return thread, result


def test_requests_from_different_calls_run_together_and_a_short_one_returns_first(loop, engine):
    finished = []
    long_call, _ = in_thread(lambda: finished.append(("long", loop.run(["a"], [40]))))
    time.sleep(0.05)
    short_call, _ = in_thread(lambda: finished.append(("short", loop.run(["b", "c"], [3, 3]))))
    short_call.join(5)
    long_call.join(5)
    assert [name for name, _ in finished] == ["short", "long"]
    assert engine.max_together == 3  # batched in the same steps, not one call after the other
    assert all(out is not None and out.finished for _, outs in finished for out in outs)


def test_a_cancelled_call_is_aborted_in_the_engine(loop, engine):
    polls = iter([False, False, True])
    outs = loop.run(["a", "b"], [1, 10_000], cancelled=lambda: next(polls, True))
    assert outs[0] is not None and outs[0].finished  # finished before the cancel
    assert outs[1] is None  # aborted
    assert len(engine.aborted) == 1 and not engine.has_unfinished_requests()


def test_pause_waits_for_running_requests_and_holds_new_ones_until_resume(loop, engine):
    first, _ = in_thread(lambda: loop.run(["running"], [20]))
    time.sleep(0.05)
    loop.pause()  # returns only once "running" is done
    assert not engine.has_unfinished_requests()
    first.join(5)
    held, result = in_thread(lambda: loop.run(["held"], [1]))
    time.sleep(0.1)
    assert held.is_alive() and "add held" not in engine.log
    assert loop.call(lambda: "weights loaded") == "weights loaded"  # runs while nothing runs
    engine.log.append("update")
    loop.resume()
    held.join(5)
    assert result["value"][0].finished
    assert engine.log.index("update") < engine.log.index("add held")


def test_a_rejected_request_fails_its_own_call_only(loop):
    ok, result = in_thread(lambda: loop.run(["fine"], [5]))
    with pytest.raises(ValueError, match="prompt too long"):
        loop.run(["bad"], [1])
    ok.join(5)
    assert result["value"][0].finished


def test_an_engine_failure_reaches_every_caller_and_later_calls(engine):
    def broken_step():
        raise RuntimeError("out of KV cache")
    engine.step = broken_step
    loop = EngineLoop(engine)
    with pytest.raises(RuntimeError, match="out of KV cache"):
        loop.run(["a"], [1])
    with pytest.raises(RuntimeError, match="stopped.*out of KV cache"):
        loop.submit("b", 1)


def test_close_ends_the_thread_and_fails_what_is_still_pending(engine):
    """The strategy's ``close`` stops the loop: its thread ends (it holds the engine, which could
    not be freed otherwise), a caller waiting on a request or a call learns why, later calls fail."""
    loop = EngineLoop(engine)
    loop.freeze()  # the request below stays unfinished in the engine
    waiting, result = in_thread(lambda: _raised(lambda: loop.run(["long"], [10_000])))
    time.sleep(0.1)
    assert waiting.is_alive()
    loop.close()
    waiting.join(5)
    assert not waiting.is_alive() and "closed" in str(result["value"])
    assert not loop._thread.is_alive()
    with pytest.raises(RuntimeError, match="stopped"):
        loop.call(lambda: None)
    loop.close()  # twice: nothing more


def _raised(fn):
    try:
        fn()
    except RuntimeError as exc:
        return exc
    return None


def test_freeze_stops_stepping_at_once_and_running_requests_continue_after_resume(loop, engine):
    running, result = in_thread(lambda: loop.run(["long"], [30]))
    time.sleep(0.05)
    loop.freeze()
    time.sleep(0.03)  # the step under way, if any, finishes
    left = dict(engine.left)
    time.sleep(0.1)
    assert engine.left == left and left  # unfinished, and not stepped while frozen
    assert loop.call(lambda: "weights loaded") == "weights loaded"  # runs although a request is running
    held, _ = in_thread(lambda: loop.run(["new"], [1]))
    time.sleep(0.05)
    assert "add new" not in engine.log  # new requests wait too
    loop.resume()
    running.join(5)
    held.join(5)
    assert result["value"][0].finished and "add new" in engine.log


def test_a_pause_waits_for_a_whole_call_whose_later_requests_still_run(loop, engine):
    """A generation and the pass that re-scores it run as one whole call: a weight update's pause
    must not land between them, and must not hold the second batch back while it waits."""
    def whole():
        with loop.whole_call():
            first = loop.run(["generate"], [10])
            time.sleep(0.1)  # the pause arrives in between
            return first + loop.run(["rescore"], [5])

    call, result = in_thread(whole)
    time.sleep(0.05)
    paused, _ = in_thread(loop.pause)
    time.sleep(0.05)
    assert paused.is_alive()  # waiting for the whole call, whose second batch is admitted meanwhile
    call.join(5)
    paused.join(5)
    assert not call.is_alive() and not paused.is_alive()
    assert all(out.finished for out in result["value"])
    assert engine.log == ["add generate", "add rescore"]
    late, late_result = in_thread(lambda: loop.run(["late"], [1]))  # held until the resume
    entered, _ = in_thread(lambda: loop.whole_call().__enter__())  # a whole call waits for the resume
    time.sleep(0.1)
    assert entered.is_alive() and "add late" not in engine.log
    engine.log.append("update")
    loop.resume()
    entered.join(5)
    late.join(5)
    assert not entered.is_alive() and late_result["value"][0].finished
    assert engine.log.index("update") < engine.log.index("add late")


def test_run_alone_drains_the_engine_changes_it_runs_alone_and_undoes_the_change(loop, engine):
    """vLLM re-scores at a temperature by scaling its logits: no other caller's request may be in
    the engine from the change to its undoing, and the undoing happens even when the run fails."""
    def change(what):
        return lambda: engine.log.append(f"{what} with {sorted(engine.left)} running")

    running, _ = in_thread(lambda: loop.run(["running"], [10]))
    time.sleep(0.03)
    alone, result = in_thread(lambda: loop.run_alone(["x", "y"], [4, 4], change("scale"), change("unscale")))
    time.sleep(0.03)
    later, later_result = in_thread(lambda: loop.run(["later"], [1]))  # held until the run alone ends
    for thread in (running, alone, later):
        thread.join(5)
    assert engine.log == ["add running", "scale with [] running", "add x", "add y", "unscale with [] running",
                          "add later"]
    assert engine.max_together == 2 and [out.finished for out in result["value"]] == [True, True]
    assert later_result["value"][0].finished
    engine.log.clear()
    with pytest.raises(ValueError, match="prompt too long"):  # a rejected request: undone all the same
        loop.run_alone(["bad"], [1], change("scale"), change("unscale"))
    assert engine.log == ["scale with [] running", "unscale with [] running"]
    assert loop.run(["after"], [1])[0].finished  # and the engine takes everyone's requests again


def test_a_call_cancelled_while_its_requests_are_held_never_reaches_the_engine(loop, engine):
    loop.pause()
    outs = loop.run(["held", "also held"], [1, 1], cancelled=lambda: True)
    assert outs == [None, None]
    loop.resume()
    assert loop.run(["after"], [1])[0].finished
    assert engine.log == ["add after"] and engine.aborted == []  # dropped from the queue, not aborted in the engine


def test_only_a_finished_output_completes_a_request(loop, engine):
    step = engine.step

    def step_with_partial_outputs():  # as vLLM's engine reports tokens so far, finished or not
        partial = [SimpleNamespace(request_id=rid, finished=False, value="so far") for rid in engine.left]
        return partial + step()
    engine.step = step_with_partial_outputs
    out = loop.run(["a"], [3])[0]
    assert out.finished and out.value != "so far"


def test_a_call_on_the_loop_thread_that_raises_fails_its_caller_and_the_loop_goes_on(loop):
    with pytest.raises(ZeroDivisionError):
        loop.call(lambda: 1 / 0)
    assert loop.run(["a"], [1])[0].finished


def test_run_alone_waits_for_a_pause_to_end_and_a_cancelled_one_is_aborted_and_undone(loop, engine):
    loop.pause()
    alone, result = in_thread(lambda: loop.run_alone(["x"], [1], lambda: engine.log.append("scale"),
                                                     lambda: engine.log.append("unscale")))
    time.sleep(0.1)
    assert alone.is_alive() and engine.log == []  # nothing runs alone during a pause
    loop.resume()
    alone.join(5)
    assert engine.log == ["scale", "add x", "unscale"] and result["value"][0].finished
    engine.log.clear()
    polls = iter([False, False, True])
    outs = loop.run_alone(["long"], [10_000], lambda: engine.log.append("scale"),
                          lambda: engine.log.append("unscale"), cancelled=lambda: next(polls, True))
    assert outs == [None] and len(engine.aborted) == 1 and engine.log == ["scale", "add long", "unscale"]


def test_a_whole_call_that_starts_while_a_pause_waits_is_held_until_the_resume(loop):
    """Once a pause waits for the whole calls under way, no new one starts: one that did would keep
    the pause waiting longer, and a stream of them would keep it waiting for ever."""
    release, order = threading.Event(), []

    def first():
        with loop.whole_call():
            release.wait(5)

    def second():
        with loop.whole_call():
            order.append("second")

    def until(condition):  # the loop's own state, so that no step races the one before on a busy machine
        deadline = time.monotonic() + 5
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.005)

    running, _ = in_thread(first)
    until(lambda: loop._whole == 1)
    paused, _ = in_thread(loop.pause)
    until(lambda: loop._pausing)
    late, _ = in_thread(second)
    time.sleep(0.1)
    assert paused.is_alive() and late.is_alive() and order == []
    release.set()
    paused.join(5)
    running.join(5)
    assert not paused.is_alive()  # the pause ended with the first call; the second is still held
    time.sleep(0.05)
    assert late.is_alive() and order == []
    order.append("resume")
    loop.resume()
    late.join(5)
    assert order == ["resume", "second"]
