"""Calls into plugin code that may hang: run them in a thread of their own and stop waiting at a deadline.

A Python thread cannot be killed, so a call past its deadline is *abandoned*: it runs on (a daemon
thread, never joined at exit) and its caller gets :class:`Hung` at once, builds a fresh object in
place of the stuck one, and keeps serving. Reward workers (``roles.reward.timeout_s``) and
environment workers (``agentic.step_timeout_s``) both use this; a worker that abandoned calls may
also be replaced by its driver, which on Ray ends the process and the stuck thread with it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


class Hung(Exception):
    """The call did not finish within its deadline and was abandoned."""


def call_with_deadline(fn: Callable[[], Any], deadline_s: float, name: str) -> Any:
    """``fn()``'s result, or its exception re-raised, or :class:`Hung` after ``deadline_s`` seconds
    (the call left running in the thread ``name``)."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # handed to the calling thread below
            box["error"] = exc

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        raise Hung(f"{name} did not return within {deadline_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["result"]
