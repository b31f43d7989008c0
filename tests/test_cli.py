"""The ``roll`` command explains itself: its version, its help, the descriptions of what plugins
registered, and where a component's name comes from."""

from __future__ import annotations

import json
import os
import re

import pytest
from conftest import run_roll


def test_version_and_bare_roll_print_and_exit_zero():
    version = run_roll("--version")
    assert version.returncode == 0 and re.match(r"roll-core \S+ \(Python 3\.\d+\.\d+\)", version.stdout)
    bare = run_roll()
    assert bare.returncode == 0 and "usage: roll" in bare.stdout
    for command in ("run", "validate", "list-plugins", "check-plugin", "play"):
        assert command in bare.stdout


def test_the_roll_command_is_console_which_exits_with_mains_code_after_a_collection_and_a_freeze(monkeypatch):
    """The freeze skips the interpreter's own collections at exit (benchmarks/bench_cli_exit.py);
    the collection before it still finalizes what is garbage by then. Patched here: freezing this
    test process's heap would keep its garbage for the rest of the session."""
    from importlib.metadata import entry_points

    from roll_core import cli

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "roll"]
    assert script.value == "roll_core.cli:console"
    calls = []
    monkeypatch.setattr(cli, "main", lambda: calls.append("main") or 3)
    monkeypatch.setattr(cli.gc, "collect", lambda: calls.append("collect"))
    monkeypatch.setattr(cli.gc, "freeze", lambda: calls.append("freeze"))
    with pytest.raises(SystemExit) as exited:
        cli.console()
    assert exited.value.code == 3 and calls == ["main", "collect", "freeze"]


def test_run_and_validate_help_name_the_common_overrides_quoting_and_environment():
    for command in ("run", "validate"):
        out = run_roll(command, "--help").stdout
        for needle in ("executor=local", "trainer.resume=never", "output_dir=", "'trackers=[stdout, jsonl]'",
                       "ROLL_DISABLE_PLUGINS", "ROLL_STRICT_PLUGINS"):
            assert needle in out, (command, needle)
    assert "dotted overrides applied after the file" in run_roll("validate", "--help").stdout


def test_list_plugins_shows_every_registered_description():
    listing = json.loads(run_roll("list-plugins", "--json").stdout)
    grpo = next(c for c in listing["components"] if c["name"] == "grpo")
    assert grpo["registry"] == "advantage_estimators" and grpo["plugin"] == "core.algorithms"
    assert grpo["description"].startswith("group")
    table = run_roll("list-plugins", "-v", env_extra={"COLUMNS": "200"}).stdout
    assert "registered names" in table and grpo["description"][:30] in table
    assert "list-plugins -v" in run_roll("list-plugins").stdout  # the short form says how to get them


def test_every_built_in_registration_has_a_description():
    from roll_core.plugins import load_plugins

    missing = [(c["registry"], c["name"]) for c in load_plugins(entry_points=False).components()
               if not c["description"].strip()]
    assert missing == []


def test_check_plugin_given_a_component_name_says_which_plugin_provides_it():
    result = run_roll("check-plugin", "grpo")
    assert "'grpo' is not a plugin but a registered name: advantage estimator 'grpo' by plugin " \
           "'core.algorithms'" in result.stderr
    assert "contract checks of 'core.algorithms'" in result.stdout


def test_an_unknown_name_asks_whether_its_plugin_is_installed_or_disabled():
    result = run_roll("validate", "algorithm.policy_loss=nope")
    assert result.returncode == 2
    assert "is it installed in this Python environment (roll list-plugins), and not disabled by " \
           "ROLL_DISABLE_PLUGINS?" in result.stderr
    near_miss = run_roll("validate", "algorithm.policy_loss=ppo_clp").stderr
    assert "Did you mean 'ppo_clip'?" in near_miss and "ROLL_DISABLE_PLUGINS" not in near_miss


@pytest.mark.parametrize("executor", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_run_hides_the_libraries_progress_bars_unless_verbose(tmp_path, executor):
    common = ["trainer.max_steps=1", "warmup.steps=2", "trainer.eval_every=0", "data.eval_size=8",
              "rollout.prompts_per_step=2", "trackers=[jsonl]", f"executor={executor}"]
    quiet = run_roll("run", *common, f"output_dir={tmp_path / 'quiet'}")
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert quiet.stdout.startswith("roll run: pipeline rlvr, model tiny")
    for noise in ("Loading weights", "Writing model shards", "WARNING"):
        assert noise not in quiet.stdout + quiet.stderr
    if executor == "local":  # -v brings them back
        loud = run_roll("run", "-v", *common, f"output_dir={tmp_path / 'loud'}")
        assert loud.returncode == 0 and "Loading weights" in loud.stdout + loud.stderr


def test_run_starts_by_saying_what_it_runs():
    from roll_core.launch import describe_run
    from roll_core.config import load_config

    assert describe_run(load_config(None, [])) == ("roll run: pipeline rlvr, model tiny, data carry_addition, reward "
                                                   "exact_match, executor ray (the controller inside its one "
                                                   "worker), 200 steps -> runs/quickstart")
    assert "executor ray, 200 steps" in describe_run(load_config(None, ["ray.colocate_controller=false"]))
    agentic = load_config(None, ["pipeline=agentic", "agentic.envs=[{env: frozen_lake, name: lake}, {env: sokoban}]"])
    assert "environments lake (frozen_lake), sokoban (sokoban)" in describe_run(agentic)
    compiled = load_config(None, ["roles.actor_train.compile=true", "roles.critic.compile=true",
                                  "algorithm.advantage_estimator=gae"])
    assert describe_run(compiled).endswith("200 steps, compiling actor_train and critic in the first pass "
                                           "-> runs/quickstart")


def test_piped_output_prints_a_line_every_twentieth_of_the_run_with_evaluations_and_an_eta(capsys, tmp_path):
    from roll_core.config import load_config
    from roll_core.trackers import StdoutTracker

    tracker = StdoutTracker(tmp_path, load_config(None, ["trainer.max_steps=200"]))
    assert not tracker.live  # pytest captures stdout: not a terminal
    tracker.log({"eval/accuracy": 0.5, "warmup/loss": 1.0}, 0)
    for step in range(1, 201):
        tracker.log({"reward/mean": 0.5, "time/step_s": 0.01, **({"eval/accuracy": 0.7} if step == 55 else {})}, step)
    tracker.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[step 0] eval/accuracy=0.5 warmup/loss=1"
    steps = [int(line.split()[1].split("/")[0]) for line in lines[1:]]
    assert steps == sorted({*range(10, 201, 10), 55})  # every 10th, the evaluation, the last
    assert all(" eta " in line for line in lines[1:]) and lines[-1].startswith("[step 200/200] reward/mean=0.5")


def _unset_for_this_test(monkeypatch, *names: str) -> None:
    """Unset ``names``, recorded by monkeypatch first, so whatever the code under test sets is undone
    afterwards."""
    for name in names:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.mark.parametrize("verbose, cuda, exported, expected", [
    (False, False, None, "cpu"),     # DeepSpeed would warn that it fell back to the CPU
    (False, True, None, None),       # a GPU: DeepSpeed detects it
    (False, False, "xpu", "xpu"),    # the user's choice stays
    (True, False, None, None),       # roll run -v: every library's own messages
])
def test_quiet_runs_name_the_cpu_to_deepspeed(monkeypatch, verbose, cuda, exported, expected):
    from roll_core import cli

    _unset_for_this_test(monkeypatch, "DS_ACCELERATOR", "ROLL_VERBOSE", "HF_HUB_DISABLE_PROGRESS_BARS")
    if exported:
        monkeypatch.setenv("DS_ACCELERATOR", exported)
    monkeypatch.setattr(cli, "_has_cuda", lambda: cuda)
    cli._quiet_libraries(verbose)
    assert os.environ.get("DS_ACCELERATOR") == expected


@pytest.mark.parametrize("exported, expected", [(None, "1"), ("0", "0"), ("false", "false")])
def test_quiet_runs_hide_the_hubs_progress_bars_unless_the_user_exported_a_choice(monkeypatch, exported, expected):
    from roll_core import cli

    _unset_for_this_test(monkeypatch, "DS_ACCELERATOR", "ROLL_VERBOSE", "HF_HUB_DISABLE_PROGRESS_BARS")
    if exported is not None:
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", exported)
    monkeypatch.setattr(cli, "_has_cuda", lambda: False)
    cli._quiet_libraries(False)
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == expected
    cli._quiet_libraries(True)  # roll run -v: only its own flag
    assert os.environ["ROLL_VERBOSE"] == "1" and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == expected


def test_play_checks_its_options_and_actions_and_a_random_policy_draws_from_the_actions(roll_plugins, capsys):
    from roll_core.cli import main
    from roll_core.envs import Env
    from roll_core.testing import hooks

    class Echo(Env):
        """Records every action; ends after 8."""

        taken: list = []

        def reset(self, seed=None):
            return "go", {}

        def step(self, action):
            Echo.taken.append(action)
            return "go", 0.0, len(Echo.taken) >= 8, False, {}

    class Sized(Echo):
        def __init__(self, size: int = 4):
            if size < 2:
                raise ValueError(f"size must be at least 2, got {size}")

    def register(register):
        register("echo", Echo)
        register("sized", Sized)

    roll_plugins(("echo", hooks(roll_register_envs=register)))
    assert main(["play", "echo", "--options", "{size: 4"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --options is not valid YAML: expected ',' or '}', but got "
                                               "'<stream end>'")
    assert main(["play", "echo", "--options", "[4]"]) == 2
    assert capsys.readouterr().err.strip() == "error: --options must be a mapping such as '{size: 6}', got '[4]'"
    # options the constructor would refuse: one line each, as roll validate words them, not a traceback
    assert main(["play", "sized", "--options", '{"sise": 3}']) == 2
    assert capsys.readouterr().err.strip() == ("error: --options for environment 'sized': unknown option 'sise'. "
                                               "Did you mean 'size'? Valid options: size")
    assert main(["play", "echo", "--options", '{"size": 3}']) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --options for environment 'echo': it takes no options, got ['size']")
    assert main(["play", "sized", "--options", '{"size": 1}']) == 2
    assert capsys.readouterr().err.strip() == "error: --options for environment 'sized': size must be at least 2, got 1"
    assert main(["play", "echo", "--policy", "scripted", "--actions", ","]) == 2
    assert "error: --policy scripted needs --actions" in capsys.readouterr().err
    letters = "a,b,c,d,e,f,g,h"
    assert main(["play", "echo", "--policy", "scripted", "--actions", letters, "--max-turns", "8"]) == 0
    assert Echo.taken == letters.split(",")
    Echo.taken = []
    assert main(["play", "echo", "--policy", "random", "--actions", letters, "--max-turns", "8", "--seed", "1"]) == 0
    assert len(Echo.taken) == 8 and set(Echo.taken) <= set(letters.split(",")) and Echo.taken != letters.split(",")


def test_the_version_line_says_when_roll_core_is_not_installed(monkeypatch):
    import importlib.metadata as md

    from roll_core import cli

    assert cli._version().startswith(f"roll-core {md.version('roll-core')} (Python 3.")

    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "version", missing)
    assert cli._version().startswith("roll-core unknown (not installed) (Python 3.")


def test_a_config_file_with_an_equals_sign_in_its_name_is_read_as_a_file(tmp_path, capsys):
    from roll_core.cli import main

    config = tmp_path / "lr=3e-4.yaml"  # as a sweep names its files
    config.write_text("trainer:\n  max_steps: 3\n")
    assert main(["validate", str(config), "data.eval_size=8"]) == 0
    assert capsys.readouterr().out.startswith(f"{config}: ok (pipeline 'rlvr', executor 'ray', 3 steps")
    assert main(["validate", "trainer.max_steps=4"]) == 0  # no file: the first override stays an override
    assert capsys.readouterr().out.startswith("the embedded default: ok (pipeline 'rlvr', executor 'ray', 4 steps")


def test_ctrl_c_stops_the_run_with_130_and_says_how_to_resume_it(tmp_path, monkeypatch, capsys):
    from roll_core import cli
    from roll_core.pipelines.rlvr import RLVRPipeline

    _unset_for_this_test(monkeypatch, "DS_ACCELERATOR", "ROLL_VERBOSE", "HF_HUB_DISABLE_PROGRESS_BARS",
                         "TOKENIZERS_PARALLELISM")

    def interrupted(self):
        self.phase = "RL step 3 of 5"
        raise KeyboardInterrupt

    monkeypatch.setattr(RLVRPipeline, "run", interrupted)
    argv = ["run", "executor=local", f"output_dir={tmp_path / 'run'}"]
    assert cli.main(argv) == 130
    assert (f"interrupted during RL step 3 of 5; every worker was stopped. `roll run executor=local "
            f"output_dir={tmp_path / 'run'}` resumes from the start") in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["show-rollouts", "run", "--limit", "-1"], "argument --limit: must be at least 0, got -1"),
    (["show-rollouts", "run", "--limit", "2.5"], "argument --limit: not a whole number: '2.5'"),
    (["replay", "run", "--tolerance=-1e-3"], "argument --tolerance: must be at least 0.0, got -1e-3"),
    (["replay", "run", "--tolerance", "tight"], "argument --tolerance: not a number: 'tight'"),
    (["play", "frozen_lake", "--max-turns", "0"], "argument --max-turns: must be at least 1, got 0"),
    (["play", "frozen_lake", "--max-length", "-5"], "argument --max-length: must be at least 1, got -5"),
])
def test_counts_and_tolerances_below_their_least_value_are_refused_by_name(argv, message, capsys):
    from roll_core.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2 and capsys.readouterr().err.strip().endswith(message)
    ok = build_parser().parse_args(["show-rollouts", "run", "--limit", "0"])  # the least value itself is taken
    assert ok.limit == 0 and build_parser().parse_args(["replay", "run", "--tolerance", "0"]).tolerance == 0.0
