"""``runtime.progress.reporting``: lines while slow work runs, none for quick work."""

import time

from roll_core.runtime.progress import reporting


def test_slow_work_is_reported_while_it_runs_and_when_it_ends(capsys):
    with reporting("starting actor_train (2 workers)", every_s=0.05):
        time.sleep(0.18)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 3 and lines[-1] == "starting actor_train (2 workers): done in 0 s"
    assert all(line == "starting actor_train (2 workers): 0 s so far" for line in lines[:-1])


def test_quick_work_prints_nothing_and_an_error_passes_through(capsys):
    with reporting("starting actor_train", every_s=5.0):
        pass
    try:
        with reporting("starting actor_train", every_s=5.0):
            raise KeyError("boom")
    except KeyError as exc:
        assert exc.args == ("boom",)
    assert capsys.readouterr().out == ""
