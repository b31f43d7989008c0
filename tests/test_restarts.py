"""The restart policy after a lost worker (runtime/restarts.py), the checkpoint it names, and how a
failed Ray task's RollError reaches the user: unit tests, no workers."""

from __future__ import annotations

import pytest

from roll_core.errors import ConfigError, WorkerLostError
from roll_core.pipelines.checkpoint import CheckpointManager
from roll_core.runtime.executor import raise_roll_error
from roll_core.runtime.restarts import run_restarting


def _checkpoints(tmp_path, *steps):
    manager = CheckpointManager(tmp_path / "checkpoints", keep=10)
    for step in steps:
        manager.save(step, lambda d: None, {"step": step})
    return manager


def _flaky(losses: int, seen: list):
    """An attempt that loses a worker its first ``losses`` times, recording the ``restarts`` it got."""
    def attempt(restarts):
        seen.append(restarts)
        if len(seen) <= losses:
            raise WorkerLostError(f"a worker process died ({len(seen)})")
        return {"final_step": 4}
    return attempt


def test_resume_point_names_the_latest_complete_checkpoint(tmp_path):
    assert _checkpoints(tmp_path).resume_point() == "the start (no checkpoint yet)"
    manager = _checkpoints(tmp_path, 2, 3)
    (manager.root / "step_000009").mkdir()  # no state.json: incomplete, never resumed from
    assert manager.resume_point() == f"the last checkpoint, {manager.root / 'step_000003'}"


def test_an_attempt_that_returns_is_called_once(tmp_path, capsys):
    seen: list = []
    assert run_restarting(_flaky(0, seen), _checkpoints(tmp_path), 3) == ({"final_step": 4}, 0)
    assert seen == [0] and capsys.readouterr().out == ""


def test_each_lost_worker_restarts_the_attempt_until_the_limit(tmp_path, capsys):
    manager, seen, cleared = _checkpoints(tmp_path, 2), [], []
    result = run_restarting(_flaky(2, seen), manager, 2, restarted="it", before_restart=lambda: cleared.append(len(seen)))
    assert result == ({"final_step": 4}, 2)
    assert seen == [0, 1, 2] and cleared == [1, 2]  # cleared after each loss, before the next attempt
    lines = capsys.readouterr().out.splitlines()
    where = manager.root / "step_000002"
    assert lines == [f"warning: a worker process died (1). Restarting it from the last checkpoint, {where} (restart 1 of 2)",
                     f"warning: a worker process died (2). Restarting it from the last checkpoint, {where} (restart 2 of 2)"]


def test_past_the_limit_the_error_says_how_to_resume(tmp_path, capsys):
    manager, seen, cleared = _checkpoints(tmp_path, 5), [], []
    with pytest.raises(WorkerLostError) as info:
        run_restarting(_flaky(2, seen), manager, 1, before_restart=lambda: cleared.append(1))
    assert str(info.value) == ("a worker process died (2). No restarts left (runtime.max_restarts=1); run the same "
                               f"command again to resume from the last checkpoint, {manager.root / 'step_000005'}")
    assert str(info.value.__cause__) == "a worker process died (2)"
    assert seen == [0, 1] and cleared == [1]
    assert capsys.readouterr().out.startswith("warning: a worker process died (1). Restarting every worker from the last")


def test_no_restarts_allowed_stops_at_the_first_loss(tmp_path, capsys):
    seen: list = []
    with pytest.raises(WorkerLostError, match=r"max_restarts=0\); run the same command again to resume from "
                                              r"the start \(no checkpoint yet\)$"):
        run_restarting(_flaky(1, seen), _checkpoints(tmp_path), 0, before_restart=pytest.fail)
    assert seen == [0] and capsys.readouterr().out == ""


def test_other_errors_are_not_restarted(tmp_path):
    def attempt(restarts):
        raise ConfigError("bad key")
    with pytest.raises(ConfigError, match="^bad key$"):
        run_restarting(attempt, _checkpoints(tmp_path), 5, before_restart=pytest.fail)


class _TaskError(Exception):
    """Stands in for ray.exceptions.RayTaskError: the worker's exception is its ``cause``."""

    def __init__(self, cause):
        super().__init__(f"task failed: {cause!r}")
        self.cause = cause


def test_a_workers_roll_error_reaches_the_user_as_itself():
    error = ConfigError("reward 'x' is unknown")
    with pytest.raises(ConfigError) as info:
        raise_roll_error(_TaskError(error))
    assert info.value is error and info.value.__suppress_context__


@pytest.mark.parametrize("cause", [ValueError("boom"), None])
def test_any_other_task_error_is_raised_as_is(cause):
    task_error = _TaskError(cause)
    with pytest.raises(_TaskError) as info:
        raise_roll_error(task_error)
    assert info.value is task_error
