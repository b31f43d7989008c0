"""The loop every pipeline stands on (:class:`~roll_core.pipelines.runtime.TrainingLoop`), driven by a
pipeline without workers: its "model" is one number that step ``s`` adds ``s`` to.

The pipelines' own tests reach this loop only through whole runs on the tiny model; here each of its
rules (call order, evaluation and checkpoint cadence, resume, restarts after a lost worker, the
summary) is checked in milliseconds, on the events it causes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from roll_core.errors import ConfigError, WorkerLostError
from roll_core.pipelines.runtime import ActorLoop, TrainingLoop
from roll_core.runtime.executor import LocalExecutor
from roll_core.testing import hooks
from roll_core.trackers import Tracker

EVENTS: list[str] = []


class EventTracker(Tracker):
    """Files what the loop hands to trackers into ``EVENTS``, in order."""

    def __init__(self, run_dir, config=None):
        EVENTS.append("tracker open")

    def log(self, metrics, step):
        EVENTS.append(f"log {step} " + " ".join(f"{k}={v:g}" for k, v in sorted(metrics.items())
                                                if k != "time/iteration_s"))

    def rewind(self, step):
        EVENTS.append(f"rewind {step}")

    def close(self):
        EVENTS.append("tracker close")


class Sum(TrainingLoop):
    """Step ``s`` adds ``s`` to ``value``; a checkpoint holds ``value``; an evaluation reports it.
    ``lose`` lists steps at which a worker is lost, once each."""

    def __init__(self, config, lose=(), eval_s: float = 0.0):
        super().__init__(config, LocalExecutor())
        self.value = -1  # nothing built yet
        self.lose, self.eval_s = list(lose), eval_s

    def prepare(self):
        EVENTS.append("prepare")

    def build(self):
        EVENTS.append("build" if not self.roles.groups else f"build beside {sorted(self.roles.groups)}")
        self.roles.spawn("actor_train", _Actor, [()], None)
        self.value = 0  # a new worker starts from the initial model

    def begin(self):
        EVENTS.append("begin")
        return {"eval/value": float(self.value)}

    def before_steps(self):
        EVENTS.append("before_steps")

    def step(self, step):
        if step in self.lose:
            self.lose.remove(step)
            raise WorkerLostError(f"worker lost at step {step}")
        self.value += step
        EVENTS.append(f"step {step}")
        return {"train/value": float(self.value)}

    def evaluate(self):
        EVENTS.append("evaluate")
        time.sleep(self.eval_s)
        return {"eval/value": float(self.value)}

    def after_steps(self):
        EVENTS.append("after_steps")

    def write_checkpoint(self, tmp):
        (tmp / "value").write_text(str(self.value))
        EVENTS.append(f"save {self.value}")
        return {"value": self.value}

    def restore(self, path, state):
        self.value = int((path / "value").read_text())
        assert state["value"] == self.value and state["seed"] == self.config.seed
        EVENTS.append(f"restore {state['step']}")


@pytest.fixture
def config(tiny_config, roll_plugins):
    EVENTS.clear()
    roll_plugins(("events", hooks(roll_register_trackers=lambda register: register("events", EventTracker))))

    def make(*overrides):
        return tiny_config("trackers=[events]", "trainer.max_steps=4", *overrides)

    return make


def test_a_fresh_run_calls_each_part_in_order_and_saves_step_0_and_the_last(config):
    summary = Sum(config()).run()
    assert EVENTS == ["prepare", "tracker open", "build", "begin", "rewind -1", "log 0 eval/value=0", "save 0",
                      "before_steps", "step 1", "log 1 train/value=1", "step 2", "log 2 train/value=3",
                      "step 3", "log 3 train/value=6", "step 4", "log 4 train/value=10", "save 10",
                      "after_steps", "evaluate", "tracker close"]
    assert summary == {"steps": 4, "evaluation": {"eval/value": 10.0}, "restarts": 0}


def test_the_run_writes_its_config_first_and_its_summary_last(config):
    cfg = config()
    loop = Sum(cfg)
    loop.prepare = lambda: EVENTS.append(json.loads((loop.run_dir / "config.json").read_text())["seed"])
    summary = loop.run()
    assert EVENTS[0] == cfg.seed
    assert json.loads((loop.run_dir / "summary.json").read_text()) == summary


def test_evaluation_every_n_steps_joins_that_steps_metrics_and_the_last_one_is_not_repeated(config):
    summary = Sum(config("trainer.eval_every=2")).run()
    steps = EVENTS[EVENTS.index("before_steps") + 1:]
    assert steps == ["step 1", "log 1 train/value=1", "step 2", "evaluate", "log 2 eval/value=3 train/value=3",
                     "step 3", "log 3 train/value=6", "step 4", "evaluate", "log 4 eval/value=10 train/value=10",
                     "save 10", "after_steps", "tracker close"]
    assert summary["evaluation"] == {"eval/value": 10.0}


def test_an_evaluation_before_the_last_step_is_not_the_summarys(config):
    Sum(config("trainer.eval_every=3")).run()
    assert EVENTS.count("evaluate") == 2 and EVENTS[-3:] == ["after_steps", "evaluate", "tracker close"]


def test_checkpoints_every_n_steps_and_after_the_last(config):
    loop = Sum(config("trainer.save_every=3", "trainer.max_steps=7", "trainer.keep_checkpoints=10"))
    loop.run()
    assert [e for e in EVENTS if e.startswith("save")] == ["save 0", "save 6", "save 21", "save 28"]
    assert [s for s, _ in loop.checkpoints.complete()] == [0, 3, 6, 7]
    assert [loop.saves_after(s) for s in range(1, 8)] == [False, False, True, False, False, True, True]


def test_a_second_run_resumes_after_its_last_checkpoint_and_rewinds_the_trackers(config):
    Sum(config("trainer.save_every=2", "trainer.max_steps=3")).run()
    EVENTS.clear()
    summary = Sum(config("trainer.save_every=2", "trainer.max_steps=5")).run()
    assert EVENTS == ["prepare", "tracker open", "build", "restore 3", "rewind 3", "before_steps",
                      "step 4", "log 4 train/value=10", "save 10", "step 5", "log 5 train/value=15", "save 15",
                      "after_steps", "evaluate", "tracker close"]
    assert summary["steps"] == 5 and summary["evaluation"] == {"eval/value": 15.0}


def test_a_run_past_its_max_steps_resumes_to_nothing_and_keeps_its_step_count(config):
    Sum(config("trainer.max_steps=4")).run()
    EVENTS.clear()
    summary = Sum(config("trainer.max_steps=2")).run()
    assert "restore 4" in EVENTS and not any(e.startswith(("step", "save")) for e in EVENTS)
    assert summary["steps"] == 4 and summary["evaluation"] == {"eval/value": 10.0}


def test_resume_never_starts_over_in_the_same_directory(config):
    Sum(config()).run()
    EVENTS.clear()
    Sum(config("trainer.resume=never")).run()
    assert "begin" in EVENTS and "save 0" in EVENTS and not any(e.startswith("restore") for e in EVENTS)


def test_a_checkpoint_of_another_config_is_refused_before_anything_is_written(config):
    Sum(config()).run()
    written = Path(config().output_dir) / "config.json"
    before = written.read_text()
    EVENTS.clear()
    with pytest.raises(ConfigError, match="holds a run with a different config.*seed: 42 -> 7"):
        Sum(config("seed=7")).run()
    assert EVENTS == []  # not prepared, no tracker opened, nothing built
    assert written.read_text() == before


def test_a_resume_compares_only_the_sections_the_pipeline_reads(config):
    class ReadsNoSection(Sum):
        config_sections = frozenset()  # none of dpo, distill, warmup, ...

    Sum(config()).run()
    with pytest.raises(ConfigError, match="different config.*dpo.beta: 0.1 -> 0.5"):
        Sum(config("trainer.max_steps=5", "dpo.beta=0.5")).run()  # a pipeline that does not say reads them all
    EVENTS.clear()
    ReadsNoSection(config("trainer.max_steps=5", "dpo.beta=0.5")).run()
    assert "restore 4" in EVENTS and "step 5" in EVENTS and "begin" not in EVENTS


def test_a_lost_worker_restarts_from_the_last_checkpoint_and_the_summary_counts_it(config, capsys):
    loop = Sum(config("trainer.save_every=2", "runtime.max_restarts=1"), lose=[3])
    killed = []
    loop.executor.kill_all = lambda: killed.append(list(EVENTS))
    summary = loop.run()
    assert killed == [EVENTS[:EVENTS.index("save 3") + 1]]  # after the loss, before the rebuild
    assert EVENTS[EVENTS.index("save 3") + 1:] == [
        "build", "restore 2", "rewind 2", "before_steps", "step 3", "log 3 train/value=6", "step 4",
        "log 4 train/value=10", "save 10", "after_steps", "evaluate", "tracker close"]
    assert summary["restarts"] == 1 and summary["evaluation"] == {"eval/value": 10.0}
    assert "Restarting every worker from the last checkpoint" in capsys.readouterr().out


def test_a_restart_resumes_even_where_the_run_itself_was_told_not_to(config):
    Sum(config("trainer.save_every=2", "trainer.resume=never", "runtime.max_restarts=1"), lose=[3]).run()
    assert EVENTS.count("begin") == 1 and "restore 2" in EVENTS


def test_past_the_restart_limit_the_trackers_are_still_closed(config):
    with pytest.raises(WorkerLostError, match="No restarts left"):
        Sum(config("runtime.max_restarts=0"), lose=[2]).run()
    assert EVENTS[-1] == "tracker close"


def test_a_steps_time_takes_in_the_logging_after_it_and_leaves_out_its_evaluation(config, roll_plugins):
    times = {}

    class Times(EventTracker):
        def log(self, metrics, step):
            times[step] = metrics.get("time/iteration_s")
            time.sleep(0.1)  # a slow tracker: its time is the next step's, which the user waits for

    roll_plugins(("events", hooks(roll_register_trackers=lambda register: register("events", Times))))
    Sum(config("trainer.eval_every=2"), eval_s=0.5).run()
    assert times[0] is None and set(times) == {0, 1, 2, 3, 4}
    # at least the 0.1 s of the logging before it; far below it plus the 0.5 s evaluation
    assert all(0.1 <= times[s] < 0.45 for s in (2, 3, 4)), times


def test_the_phase_names_the_step(config):
    loop = Sum(config("trainer.max_steps=2"))
    phases = []
    step = loop.step
    loop.step = lambda s: (phases.append(loop.phase), step(s))[1]
    loop.run()
    assert phases == ["step 1 of 2", "step 2 of 2"]


class Fit(ActorLoop):
    """An :class:`ActorLoop` whose actor, stream and tokenizer are stand-ins that record their calls."""

    headline = ("eval/loss", "held-out loss", "{:.2f}", "toy steps")

    def __init__(self, config):
        super().__init__(config, LocalExecutor())
        self.loss = 2.0

    def build(self):
        self.actor = self.executor.spawn("actor_train", _Actor, [()])
        self.stream, self.tokenizer = _Stream(), _Tokenizer()

    def step(self, step):
        self.loss /= 2
        self.stream.position += 1
        return {}

    def evaluate(self):
        return {"eval/loss": self.loss} if self.loss > 0.2 else {}  # too far into the run: no held-out loss


class _Actor:
    def __init__(self, *args):  # the role's arguments and devices
        pass

    def save_checkpoint(self, path):
        (Path(path) / "model").mkdir(parents=True)

    def load_checkpoint(self, path):
        EVENTS.append(f"actor loads {path.rsplit('/', 2)[-2]}")


class _Stream:
    position = 0

    def state(self):
        return {"position": self.position}

    def load_state(self, state):
        self.position = state["position"]


class _Tokenizer:
    def save_pretrained(self, path):
        (path / "tokenizer.json").write_text("{}")


def test_an_actor_loop_checkpoints_the_actor_the_tokenizer_the_stream_and_its_first_evaluation(config, capsys):
    summary = Fit(config("trainer.max_steps=2", "trainer.keep_checkpoints=5")).run()
    assert "log 0 eval/loss=2" in EVENTS
    assert summary == {"steps": 2, "before": {"eval/loss": 2.0}, "after": {"eval/loss": 0.5}, "restarts": 0}
    assert "held-out loss: 2.00 -> 0.50 after 2 toy steps" in capsys.readouterr().out
    loop = Fit(config("trainer.max_steps=3"))
    last = loop.checkpoints.latest()
    assert (last / "actor_train" / "model" / "tokenizer.json").is_file()
    assert loop.checkpoints.load_state(last)["data"] == {"position": 2}
    EVENTS.clear()
    summary = loop.run()
    assert "actor loads step_000002" in EVENTS and loop.stream.position == 3
    assert summary["before"] == {"eval/loss": 2.0}  # the step-0 evaluation, from the checkpoint


def test_an_actor_loop_without_its_headline_metric_at_the_end_prints_no_headline(config, capsys):
    summary = Fit(config("trainer.max_steps=4")).run()
    assert summary["after"] == {} and "held-out loss" not in capsys.readouterr().out
