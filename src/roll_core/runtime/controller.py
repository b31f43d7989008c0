"""The controller inside the worker (``ray.colocate_controller``): a run whose roles all live in one
Ray worker process runs its pipeline there.

Why. Under the hybrid engine, with its rewards scored by the controller, the quickstart's every role
is in one worker process; what remained outside it was the controller's own share of each step
(decoding, scoring, advantages, tokenizing the next prompts, logging). Split between the driver and
that worker, a step still took 1.16x the local executor's on 2 cores, although the same run inside a
Ray actor, on the local executor, ran level with a plain process (``docs/benchmarks.md``, step
profile): what cost the time was handing every step from one process to the other and back, not the
worker's process or Ray's daemons. So where the layout is one process anyway, the controller moves
into it, and a step makes no Ray call at all.

How. ``roll run`` starts Ray as for any run, then one actor, :class:`ControllerHost`, on the
driver's node (the run reads and writes the driver's files). It runs the pipeline on the local
executor: every role an object in its process, the same code path and the same numbers as
``executor: local`` (which the run's ``config.json`` records; its ``summary.json`` says
``"controller": "worker"``). The pipeline's output streams back to the driver, which prints it as it comes.
If the process dies, the driver starts a fresh one that resumes from the last checkpoint, at most
``runtime.max_restarts`` times; Ctrl-C in the driver stops the actor with the cluster.
:func:`~roll_core.runtime.placement.controller_blocker` says which layouts qualify.
"""

from __future__ import annotations

import io
import json
import queue
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from roll_core.errors import WorkerLostError
from roll_core.pipelines.checkpoint import CheckpointManager
from roll_core.runtime.executor import raise_roll_error
from roll_core.runtime.restarts import run_restarting

# the host sends what the pipeline printed at most this often (and its phase when that changed),
# so a chatty run costs a message a second, not one per line
FLUSH_S = 1.0


class _Stream(io.TextIOBase):
    """A text stream whose writes go to a queue as ``(name, text)``: the pipeline's stdout and stderr."""

    def __init__(self, name: str, out: queue.Queue, tty: bool):
        super().__init__()
        self.name, self.out, self.tty = name, out, tty

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:  # the driver's terminal: progress bars draw as they would there
        return self.tty

    def write(self, text: str) -> int:
        if text:
            self.out.put((self.name, text))
        return len(text)


class ControllerHost:
    """A Ray actor that runs one pipeline on the local executor in its own process."""

    def run(self, config, tty: bool = False) -> Iterator[tuple[str, Any]]:
        """Run ``config``'s pipeline; yields ``("stdout" | "stderr", text)`` as it prints,
        ``("phase", text)`` when its phase changed, and last ``("summary", dict)``. Its error, if it
        fails, is raised here once the output before it is sent.

        The pipeline runs in a thread of its own so that this generator can send its output while
        it works (the generator waits on a queue meanwhile, taking no CPU)."""
        from roll_core.plugins import get_plugins
        from roll_core.runtime.executor import LocalExecutor

        local = config.model_copy(update={"executor": "local"})
        executor = LocalExecutor()
        pipeline = get_plugins().pipelines.get(config.pipeline)(local, executor)
        out: queue.Queue = queue.Queue()
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["summary"] = pipeline.run()
            except BaseException as exc:  # raised by the generator below, after the output before it
                box["error"] = exc
            finally:
                executor.shutdown()  # the workers' engines close, as after a run in the driver
                out.put(None)

        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Stream("stdout", out, tty), _Stream("stderr", out, tty)
        try:
            thread = threading.Thread(target=work, name="roll-controller", daemon=True)
            thread.start()
            phase, done = None, False
            while not done:
                chunks: list[tuple[str, str]] = []
                deadline = time.monotonic() + FLUSH_S
                while not done and (left := deadline - time.monotonic()) > 0:
                    try:
                        item = out.get(timeout=left)
                    except queue.Empty:
                        break
                    if item is None:
                        done = True
                    else:
                        chunks.append(item)
                for name, text in _joined(chunks):
                    yield name, text
                if pipeline.phase != phase:
                    phase = pipeline.phase
                    yield "phase", phase
        finally:
            sys.stdout, sys.stderr = saved
        thread.join()
        if "error" in box:
            raise box["error"]
        yield "summary", box["summary"]


def _joined(chunks: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Consecutive writes to the same stream as one text."""
    joined: list[tuple[str, str]] = []
    for name, text in chunks:
        if joined and joined[-1][0] == name:
            joined[-1] = (name, joined[-1][1] + text)
        else:
            joined.append((name, text))
    return joined


class HostedRun:
    """The driver's side: the pipeline's stand-in for ``roll run`` (``run``, ``phase``,
    ``resume_hint``), running it in a :class:`ControllerHost` on ``executor``'s cluster."""

    def __init__(self, config, executor):
        self.config, self.executor = config, executor
        self.phase = "start-up"
        self.checkpoints = CheckpointManager(Path(config.output_dir) / "checkpoints", config.trainer.keep_checkpoints)

    def resume_hint(self) -> str:
        return self.checkpoints.resume_point()

    def run(self) -> dict:
        # a fresh process continues this run: from its checkpoint, whatever trainer.resume said
        resumed = self.config.model_copy(update={"trainer": self.config.trainer.model_copy(update={"resume": "auto"})})
        summary, restarts = run_restarting(lambda restarts: self._attempt(resumed if restarts else self.config),
                                           self.checkpoints, self.config.runtime.max_restarts, restarted="it")
        summary = {**summary, "restarts": summary.get("restarts", 0) + restarts, "controller": "worker"}
        (Path(self.config.output_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _attempt(self, config) -> dict:
        """One host process from start to summary; :class:`WorkerLostError` if it dies first."""
        ray = self.executor.ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        # as the driver of a local run: the tokenizers' own thread pool would compete with torch's threads
        env = {"TOKENIZERS_PARALLELISM": "false"}
        if config.runtime.reuse_freed_memory:
            # the pipeline computes in a thread of its own, and glibc gives such a thread an arena of
            # its own, capped at 64 MiB a heap: larger blocks (a 95M model's logits, its embedding's
            # gradient) would then be mmap'ed and unmapped at every step, whatever mallopt says
            # (runtime.host_memory). One arena keeps them in the main heap, as in a local run.
            env["MALLOC_ARENA_MAX"] = "1"
        tty = sys.stdout.isatty()
        if tty:  # progress bars as wide as the terminal they are drawn on
            env["COLUMNS"] = str(shutil.get_terminal_size().columns)
        host = ray.remote(num_cpus=0)(ControllerHost).options(
            scheduling_strategy=here, runtime_env={"env_vars": env}).remote()
        try:
            for ref in host.run.options(num_returns="streaming").remote(config, tty):
                kind, payload = self._get(ref)
                if kind == "summary":
                    return payload
                if kind == "phase":
                    self.phase = payload
                else:
                    stream = sys.stdout if kind == "stdout" else sys.stderr
                    stream.write(payload)
                    stream.flush()
        except ray.exceptions.RayActorError as exc:
            raise WorkerLostError(f"the run's worker process died: {str(exc).splitlines()[0]}") from exc
        finally:
            self.executor.stop(host)
        raise WorkerLostError("the run's worker process ended without a summary")

    def _get(self, ref):
        ray = self.executor.ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            raise_roll_error(exc)
