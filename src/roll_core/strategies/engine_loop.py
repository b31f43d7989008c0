"""One thread drives an inference engine; any number of caller threads submit requests to it.

roll's async scheduler sends sample-level requests to an engine that declares
``concurrent_requests``: a Ray actor then serves several ``generate`` calls at once, each in its own
thread. Engines' offline entry points are not meant for concurrent callers (vLLM's ``LLM.generate``,
SGLang's ``Engine.generate``, which runs its own event loop), so an inference strategy hands its
engine to one loop thread (the strategies of roll-vllm and roll-sglang both do), which

* admits the requests callers submit and steps the engine while any is unfinished, so requests from
  different calls are batched together (continuous batching) and each call returns as soon as its
  own requests finish;
* aborts the requests of a call the scheduler cancelled (``engine.abort_request``), freeing their
  KV-cache blocks at once;
* runs exclusive work (a weight-update step, a prefix-cache reset) only when no request is running:
  :meth:`pause` holds new requests back and waits for the running ones, :meth:`resume` admits them;
  a call whose requests go in batches that must all see the same weights (a generation, then the
  pass that re-scores it) runs inside :meth:`whole_call`, which a pause waits for to end;
* runs a batch of requests alone in the engine (:meth:`run_alone`), with a change to the engine made
  before them and undone after them while nothing runs: vLLM re-scores at a temperature by scaling
  its logits, which must not reach other callers' draws;
* or, for partial rollouts, :meth:`freeze` stops stepping at once: running requests keep what they
  generated and continue after :meth:`resume` (on the new weights, if the exclusive work loaded
  some and the engine re-computes their KV cache, as vLLM does when its prefix cache is reset with
  its running requests).

The engine is anything with vLLM's ``LLMEngine`` step interface: ``add_request(id, prompt, params)``,
``step()`` (the outputs of this step; those with ``finished`` set are final), ``abort_request(ids)``
and ``has_unfinished_requests()``. An engine without steps is adapted to it (roll-sglang). Tested
with a fake engine in ``tests/test_engine_loop.py`` and on vLLM in roll-vllm's tests.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, Callable, Iterator, Sequence


class EngineLoop:
    """Serve ``submit``/``call`` from many threads on one engine-owning thread (see the module docstring)."""

    def __init__(self, engine: Any, name: str = "engine-loop"):
        self.engine = engine
        self._cond = threading.Condition()
        self._incoming: list[tuple[str, Any, Any]] = []  # (request id, prompt, params) not yet added
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[], Any], Future]] = []
        self._waiting: dict[str, Future] = {}  # added to the engine, not finished
        self._paused = False
        self._frozen = False  # no stepping either: running requests wait where they are
        self._whole = 0  # calls inside whole_call()
        self._pausing = False  # a pause waits for those calls: no new one starts
        self._alone: set[str] | None = None  # during run_alone(): the only requests admitted
        self._stopped = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- caller side --------------------------------------------------------------------------------
    def submit(self, prompt: Any, params: Any, alone: bool = False) -> tuple[str, Future]:
        """Queue one request; its future resolves to the engine's final output (or is cancelled
        by :meth:`abort`). ``alone``: one of :meth:`run_alone`'s."""
        rid = f"roll-{next(self._ids)}"
        future: Future = Future()
        with self._cond:
            self._check_alive()
            if alone:
                assert self._alone is not None, "alone requests are run_alone()'s"
                self._alone.add(rid)
            self._incoming.append((rid, prompt, params))
            self._waiting[rid] = future
            self._cond.notify_all()
        return rid, future

    def run(self, prompts: Sequence[Any], params: Sequence[Any], cancelled: Callable[[], bool] = lambda: False,
            poll_s: float = 0.05, alone: bool = False) -> list[Any | None]:
        """Submit one request per prompt and wait for all of them. When ``cancelled()`` turns true
        while waiting, the unfinished ones are aborted and come back as None."""
        submitted = [self.submit(p, sp, alone) for p, sp in zip(prompts, params)]
        futures = [f for _, f in submitted]
        while wait_futures(futures, timeout=poll_s).not_done:
            if cancelled():
                self.abort([rid for rid, f in submitted if not f.done()])
                break
        wait_futures(futures)
        return [None if f.cancelled() else f.result() for f in futures]

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests (queued or running); their futures are cancelled."""
        with self._cond:
            self._aborts.extend(request_ids)
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on the loop thread while no request is running and return its result. Used
        between :meth:`pause` and :meth:`resume`, where nothing is running anyway."""
        future: Future = Future()
        with self._cond:
            self._check_alive()
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future.result()

    @contextlib.contextmanager
    def whole_call(self) -> Iterator[None]:
        """The requests submitted inside the block run on one set of weights: a :meth:`pause` waits
        for the block to end before it holds requests back, and a block starts only when no pause is
        on. (Holding back a block's later requests while waiting for the block would never end.)"""
        with self._cond:
            self._cond.wait_for(lambda: self._stopped or not (self._paused or self._pausing))
            self._check_alive()
            self._whole += 1
        try:
            yield
        finally:
            with self._cond:
                self._whole -= 1
                self._cond.notify_all()

    def run_alone(self, prompts: Sequence[Any], params: Sequence[Any], before: Callable[[], Any],
                  after: Callable[[], Any], cancelled: Callable[[], bool] = lambda: False) -> list[Any | None]:
        """:meth:`run` these requests with no other request in the engine: other callers' new
        requests are held back, the running ones finish, ``before()`` runs on the loop thread, then
        these requests, then ``after()`` (also when they fail or are cancelled), and the held
        requests go in. One such run at a time; none starts during a pause."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopped or not (self._paused or self._alone is not None))
            self._check_alive()
            self._alone = set()
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._stopped or not self._running())
        try:
            self._check_alive()
            self.call(before)
            try:
                return self.run(prompts, params, cancelled, alone=True)
            finally:
                self.call(after)
        finally:
            with self._cond:
                self._alone = None
                self._cond.notify_all()

    def pause(self) -> None:
        """Wait for every :meth:`whole_call` to end, then hold new requests back and return once
        every running request has finished."""
        with self._cond:
            self._pausing = True
            self._cond.wait_for(lambda: self._stopped or not self._whole)
            self._paused = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._stopped or not self._running())
            self._check_alive()

    def freeze(self) -> None:
        """Hold new requests back and stop stepping the engine after the current step; running
        requests stay in the engine, unfinished, until :meth:`resume`. :meth:`call` runs at once."""
        with self._cond:
            self._paused = self._frozen = True
            self._cond.notify_all()

    def resume(self) -> None:
        """End a :meth:`pause` or a :meth:`freeze`."""
        with self._cond:
            self._paused = self._frozen = self._pausing = False
            self._cond.notify_all()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the loop thread, and with it the thread's hold on the engine; a request or call still
        pending fails, so no caller waits for ever. The engine itself is its owner's to shut down
        (the strategy's ``close``). Closing twice does nothing more."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)
        self._fail_pending(RuntimeError("the engine loop was closed"))

    # -- loop side ----------------------------------------------------------------------------------
    def _running(self) -> bool:
        """Requests admitted to the engine and not finished (caller holds the lock)."""
        return len(self._waiting) > len(self._incoming)

    def _check_alive(self) -> None:
        if self._stopped:
            raise RuntimeError("the engine loop has stopped" + (f": {self._error!r}" if self._error else ""))

    def _admissible(self) -> list[tuple[str, Any, Any]]:
        """The queued requests the engine may take now (caller holds the lock)."""
        if self._paused:
            return []
        if self._alone is not None:
            return [r for r in self._incoming if r[0] in self._alone]
        return self._incoming

    def _has_work(self) -> bool:
        return bool(self._stopped or self._aborts or self._calls or self._admissible()
                    or (self._running() and not self._frozen))

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(self._has_work)
                    if self._stopped:
                        break
                    aborts, self._aborts = self._aborts, []
                    admitted = self._admissible()
                    if admitted:
                        taken = {rid for rid, _, _ in admitted}
                        self._incoming = [r for r in self._incoming if r[0] not in taken]
                    frozen = self._frozen
                    idle = (frozen or not self._running()) and not admitted
                    calls, self._calls = (self._calls, []) if idle else ([], self._calls)
                self._abort(aborts)
                for rid, prompt, params in admitted:
                    self._add(rid, prompt, params)
                for fn, future in calls:
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # handed to the caller, the loop goes on
                        future.set_exception(exc)
                if not frozen and self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
        except BaseException as exc:  # the engine failed: every caller learns why
            self._error = exc
            self._fail_pending(RuntimeError(f"the inference engine failed: {exc!r}"))
        finally:
            with self._cond:
                self._stopped = True
                self._cond.notify_all()

    def _fail_pending(self, error: BaseException) -> None:
        """Stop, and fail every request and call not yet answered with ``error``."""
        with self._cond:
            self._stopped = True
            pending = list(self._waiting.values()) + [f for _, f in self._calls]
            self._waiting.clear()
            self._calls.clear()
            self._cond.notify_all()
        for future in pending:
            if not future.done():
                future.set_exception(error)

    def _add(self, rid: str, prompt: Any, params: Any) -> None:
        """Add one request; one the engine rejects (a prompt too long, bad parameters) fails its own
        caller and no other."""
        try:
            self.engine.add_request(rid, prompt, params)
        except Exception as exc:
            with self._cond:
                future = self._waiting.pop(rid, None)
                self._cond.notify_all()
            if future is not None:
                future.set_exception(exc)

    def _abort(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        with self._cond:
            queued = {rid for rid, _, _ in self._incoming} & set(request_ids)
            self._incoming = [r for r in self._incoming if r[0] not in queued]
            futures = [self._waiting.pop(rid) for rid in request_ids if rid in self._waiting]
            self._cond.notify_all()  # a pause may be waiting for these
        running = [rid for rid in request_ids if rid not in queued]
        if running:
            self.engine.abort_request(running)
        for future in futures:
            future.cancel()
            future.set_running_or_notify_cancel()  # wakes concurrent.futures.wait(), which cancel() alone does not

    def _deliver(self, outputs: list[Any]) -> None:
        finished = []
        with self._cond:
            for out in outputs:
                if out.finished and out.request_id in self._waiting:
                    finished.append((self._waiting.pop(out.request_id), out))
            self._cond.notify_all()  # a pause may be waiting for these
        for future, out in finished:
            future.set_result(out)
