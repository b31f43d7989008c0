"""``roll_core.run``: a job started from Python, with plugins defined in the caller's process."""

from __future__ import annotations

import json

import pytest

import roll_core
from roll_core.errors import ConfigError
from roll_core.rewards import Reward
from roll_core.testing import hooks


class CountingReward(Reward):
    """Exact match, counting the samples it scored (in this process: the local executor's)."""

    scored = 0

    def score(self, sample) -> float:
        type(self).scored += 1
        return float(sample.response.strip() == str(sample.ground_truth).strip())


class CountingRewards:
    """A plugin as a notebook writes one (the README's form): hooks as methods of an instance."""

    @roll_core.hookimpl
    def roll_register_rewards(self, register):
        register("counting", CountingReward)


def rewards_plugin():
    return CountingRewards()


def test_a_run_from_python_uses_an_in_process_reward_and_returns_its_summary(tmp_path, capsys):
    from roll_core.plugins import get_plugins, reset_plugins

    reset_plugins(None)
    CountingReward.scored = 0
    out = tmp_path / "run"
    summary = roll_core.run(None, [f"output_dir={out}", "executor=local", "warmup.steps=0", "trainer.max_steps=2",
                                   "rollout.prompts_per_step=2", "rollout.num_return_sequences=2",
                                   "trainer.eval_every=0", "trainer.save_every=0", "data.eval_size=3",
                                   "trackers=[jsonl]", "roles.reward.name=counting"],
                            plugins={"counting_rewards": rewards_plugin()})
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["restarts"] == 0 and set(summary["after_rl"]) >= {"eval/accuracy"}
    assert CountingReward.scored == 2 * 2 * 2 + 2 * 3  # steps x prompts x samples, 2 evaluations x held-out rows
    assert "roll run: pipeline rlvr, model tiny, data carry_addition, reward counting, executor local" in (
        capsys.readouterr().out)
    # the in-process plugin was for that call only
    assert "counting" not in get_plugins().rewards.names()


def test_in_process_plugins_need_the_local_executor_and_nothing_starts_without_it(tmp_path, monkeypatch):
    from roll_core import runtime

    monkeypatch.setattr(runtime, "make_executor", lambda cfg: pytest.fail("an executor was started"))
    with pytest.raises(ConfigError) as err:
        roll_core.run(None, [f"output_dir={tmp_path}", "executor=ray", "roles.reward.name=counting"],
                      plugins={"counting_rewards": rewards_plugin()})
    assert str(err.value) == (
        "in-process plugins (counting_rewards) reach only this process, and executor 'ray' runs workers in "
        "others: pass executor=local, or install them as a package (roll plugin new) so that every worker finds them")
    assert not list(tmp_path.iterdir())
    from roll_core.plugins import get_plugins

    assert "counting" not in get_plugins().rewards.names()  # a call that failed leaves the plugins as they were


def test_a_name_only_an_in_process_plugin_gives_is_unknown_without_it(tmp_path):
    with pytest.raises(ConfigError, match="unknown reward 'counting'"):
        roll_core.run(None, [f"output_dir={tmp_path}", "executor=local", "roles.reward.name=counting"])


def test_overrides_given_as_one_string_are_refused():
    with pytest.raises(TypeError, match="overrides is a list of 'key=value' strings, got the string 'executor=local'"):
        roll_core.run(None, "executor=local")


def test_ctrl_c_stops_the_executor_and_says_where_the_run_resumes(tmp_path, monkeypatch, capsys):
    import os

    from roll_core import runtime
    from roll_core.launch import INTERRUPTED_CLOSE_S, RunInterrupted
    from roll_core.runtime import cpu_share

    stopped = []

    class Executor:
        def shutdown(self, close_within=None):
            stopped.append(close_within)

    class Interrupted:
        def __init__(self, config, executor):
            self.phase = "training (step 3)"

        def resume_hint(self):
            return "step 2's checkpoint"

        def run(self):
            raise KeyboardInterrupt

    monkeypatch.setattr(runtime, "make_executor", lambda cfg: Executor())
    # on the way: the warning about busy cores, and tokenizers kept single-threaded for the workers' forks
    monkeypatch.setattr(cpu_share, "busy_cores", lambda: 1.5)
    monkeypatch.setattr(cpu_share.os, "cpu_count", lambda: 2)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    with pytest.raises(RunInterrupted) as err:
        roll_core.run(None, [f"output_dir={tmp_path}", "executor=local", "pipeline=stops", "torch_threads=2"],
                      plugins={"stops": hooks(roll_register_pipelines=lambda register: register("stops", Interrupted))})
    assert (err.value.phase, err.value.resume_from) == ("training (step 3)", "step 2's checkpoint")
    # interrupted, workers still busy in other processes are not waited for to close
    assert isinstance(err.value, KeyboardInterrupt) and stopped == [INTERRUPTED_CLOSE_S] and INTERRUPTED_CLOSE_S <= 5

    class Finishes(Interrupted):
        def run(self):
            return {"steps": 0}

    roll_core.run(None, [f"output_dir={tmp_path}", "executor=local", "pipeline=ends"],
                  plugins={"ends": hooks(roll_register_pipelines=lambda register: register("ends", Finishes))})
    assert stopped == [INTERRUPTED_CLOSE_S, None]  # a run that ends waits the executor's own time
    assert "warning: other processes keep about 1.5 of this machine's 2 cores busy" in capsys.readouterr().out
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"


def test_roll_core_names_run_without_importing_it_for_plugins():
    import subprocess
    import sys

    code = ("import sys, roll_core; assert 'roll_core.launch' not in sys.modules; "
            "assert 'torch' not in sys.modules; from roll_core import run; print(run.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "roll_core.launch"
    with pytest.raises(AttributeError, match="no attribute 'rnu'"):
        roll_core.rnu  # noqa: B018
