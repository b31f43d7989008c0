"""Restarting a run after a lost worker (``runtime.max_restarts``): one policy for every controller.

A worker process that dies, or stops answering within ``runtime.worker_timeout_s``, surfaces in the
controller as :class:`~roll_core.errors.WorkerLostError`. Whether the controller runs in the driver
(:class:`~roll_core.pipelines.runtime.TrainingLoop`) or in the run's one worker
(:class:`~roll_core.runtime.controller.HostedRun`), what follows is the same: start the attempt again
from the last complete checkpoint, at most ``max_restarts`` times, saying so; once they are spent,
stop with the command that resumes by hand.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from roll_core.errors import WorkerLostError
from roll_core.pipelines.checkpoint import CheckpointManager

T = TypeVar("T")


def run_restarting(attempt: Callable[[int], T], checkpoints: CheckpointManager, max_restarts: int,
                   restarted: str = "every worker", before_restart: Callable[[], None] | None = None) -> tuple[T, int]:
    """``attempt(restarts)`` until it returns; returns its result and how many restarts it took.

    After a :class:`WorkerLostError` the attempt is called again (``before_restart()`` first, to
    clear what the lost one left) with ``restarts`` one higher, up to ``max_restarts`` times; a
    warning names ``restarted`` and the checkpoint it resumes from. Past that, the error is raised
    again with the limit and the checkpoint that ``roll run`` would resume from.
    """
    restarts = 0
    while True:
        try:
            return attempt(restarts), restarts
        except WorkerLostError as exc:
            where = checkpoints.resume_point()
            if restarts >= max_restarts:
                raise WorkerLostError(f"{exc}. No restarts left (runtime.max_restarts={max_restarts}); "
                                      f"run the same command again to resume from {where}") from exc
            restarts += 1
            print(f"warning: {exc}. Restarting {restarted} from {where} (restart {restarts} of {max_restarts})",
                  flush=True)
            if before_restart is not None:
                before_restart()
