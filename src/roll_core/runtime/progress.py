"""A line now and then while slow work runs that prints nothing of its own.

Starting a run's model roles loads their models: under a second for the tiny model, minutes for a
large one on a cluster, and nothing is printed meanwhile. :func:`reporting` says what is still
running every ``every_s`` seconds, and how long it took in the end, so a long start does not look
like a hang; work that ends before the first report adds no line at all (the quickstart's output
stays as it is).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator


@contextlib.contextmanager
def reporting(what: str, every_s: float) -> Iterator[None]:
    """Print ``"<what>: <n> s so far"`` every ``every_s`` seconds while the block runs, then
    ``"<what>: done in <n> s"`` if anything was printed (from a daemon thread; nothing is printed
    for a block that ends sooner)."""
    start = time.perf_counter()
    done = threading.Event()
    reported = threading.Event()

    def report() -> None:
        while not done.wait(every_s):
            print(f"{what}: {time.perf_counter() - start:.0f} s so far", flush=True)
            reported.set()

    thread = threading.Thread(target=report, name="roll-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if reported.is_set():
            print(f"{what}: done in {time.perf_counter() - start:.0f} s", flush=True)
