"""The ``roll`` command.

    roll run [-v] [CONFIG] [key=value ...]  run a pipeline (no CONFIG: the embedded quickstart;
                                            -v: keep the libraries' progress bars)
    roll validate [CONFIG] [key=value ...]  check a config against the schema and installed plugins
    roll list-plugins [-v] [--json]         installed plugins and what each provides (-v: every
                                            registered name with its description)
    roll check-plugin NAME                  a plugin's contract checks (exit 1 when one fails)
    roll play ENV                           one episode of an environment, printed
    roll report RUN_DIR [RUN_DIR ...]       PNG plots and one HTML page of runs (several overlaid)
    roll show-rollouts RUN_DIR [--step N]   a step's dumped samples (trainer.dump_rollouts_every)
    roll replay RUN_DIR [--steps A-B]       train again on dumped batches; compare loss and grad norm
    roll export-pairs RUN_DIR -o FILE       dumped samples as preference pairs (best and worst per prompt)
    roll plugin new KIND NAME               a third-party plugin package to start from
    roll --version                          roll-core's version; bare ``roll`` prints the help

User errors (bad config, unknown names, broken data) print one message and exit with status 2;
nothing already written to the run directory is removed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys
from typing import Any, NoReturn

from roll_core.errors import RollError


def _cmd_list_plugins(args) -> int:
    # Only the registration hooks run: every target is a lazy string, so no backend is imported.
    from roll_core.plugins import get_plugins

    listing = get_plugins().listing()
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"roll plugins (Python {listing['python']['version']}, {listing['python']['executable']})")
    for col in ("plugin", "distribution", "version", "status", "provides"):
        table.add_column(col, overflow="fold")
    for p in listing["plugins"]:
        provides = "\n".join(f"{k}: {', '.join(v)}" for k, v in p["provides"].items())
        if not provides and p["status"] == "ok":  # a plugin whose dependency is missing, say: its own words
            provides = f"nothing registered here. {p['summary']}".strip()
        status = p["status"] if not p["error"] else f"{p['status']}: {p['error']}"
        style = {"broken": "red", "disabled": "yellow"}.get(p["status"])
        table.add_row(p["name"], p["distribution"], p["version"], status, provides, style=style)
    console = Console(width=max(120, Console().width))
    console.print(table)
    if not args.verbose:
        console.print("roll list-plugins -v lists every registered name with its description.")
        return 0
    names = Table(title="registered names")
    for col in ("registry", "name", "plugin", "description"):
        names.add_column(col, overflow="fold")
    for c in listing["components"]:
        names.add_row(c["registry"], c["name"], c["plugin"], c["description"] or "-")
    console.print(names)
    return 0


def _cmd_plugin_new(args) -> int:
    from roll_core.scaffold import new_plugin

    root = new_plugin(args.kind, args.name, args.dir)
    print(f"wrote {root}/ (a {args.kind} registered as '{args.name}'). Next:\n"
          f"  pip install -e '{root}[test]' && pytest {root}/tests && roll check-plugin {args.name}")
    return 0


def _cmd_check_plugin(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from roll_core.contracts import check_plugin

    from roll_core.plugins import get_plugins

    plugins = get_plugins()
    provided = plugins.provider_of(args.name)
    if args.name not in plugins.plugins and provided:
        where = ", ".join(f"{kind} '{args.name}' by plugin '{plugin}'" for kind, plugin in provided)
        print(f"'{args.name}' is not a plugin but a registered name: {where}. "
              f"Checking plugin '{provided[0][1]}'.", file=sys.stderr)
        args.name = provided[0][1]
    report = check_plugin(args.name)
    table = Table(title=f"contract checks of '{args.name}'")
    for col in ("component", "check", "result", "detail"):
        table.add_column(col, overflow="fold")
    styles = {"ok": "green", "failed": "red", "skipped": "yellow"}
    for r in report.results:
        table.add_row(r.component, r.check, r.status, r.detail, style=styles[r.status])
    Console(width=max(120, Console().width)).print(table)
    counts = {s: sum(r.status == s for r in report.results) for s in ("ok", "failed", "skipped")}
    print(f"{counts['ok']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return 1 if counts["failed"] else 0


def _cmd_validate(args) -> int:
    from roll_core.config import load_and_check

    from roll_core.pipelines import pipeline_class

    cfg = load_and_check(args.config, args.overrides)
    print(f"{args.config or 'the embedded default'}: ok (pipeline '{cfg.pipeline}', executor '{cfg.executor}', "
          f"{pipeline_class(cfg).planned_steps(cfg)} steps, output_dir '{cfg.output_dir}')")
    return 0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _quiet_libraries(verbose: bool) -> None:
    """Hide the progress bars transformers draws at every model load and save, here and in the
    workers this run starts (they inherit ``HF_*`` variables), DeepSpeed's CPU fallback warning and
    Ray's start-up warnings; ``roll run -v`` keeps them. A value the user exported wins."""
    if verbose:
        os.environ["ROLL_VERBOSE"] = "1"  # Ray's start-up warnings too (runtime.executor)
        return
    if not os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"):
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    # transformers imports DeepSpeed wherever it is installed (roll-deepspeed), and DeepSpeed warns
    # that it fell back to the CPU when it finds no GPU; naming the CPU up front says the same
    # silently. Set before Ray starts, so this machine's workers inherit it; other nodes detect theirs.
    if "DS_ACCELERATOR" not in os.environ and not _has_cuda():
        os.environ["DS_ACCELERATOR"] = "cpu"
    if "transformers" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"].lower() not in ("0", "false"):
        from transformers.utils import logging

        logging.disable_progress_bar()


def _cmd_run(args) -> int:
    from roll_core.launch import RunInterrupted, run

    _quiet_libraries(args.verbose)
    try:
        run(args.config, args.overrides)
    except RunInterrupted as stop:
        command = "roll " + shlex.join(args.argv)
        print(f"interrupted during {stop.phase}; every worker was stopped. `{command}` resumes from "
              f"{stop.resume_from}.", file=sys.stderr, flush=True)
        return 130
    return 0


def _cmd_play(args) -> int:
    """One episode in this process, printed turn by turn: the environment's debugging loop."""
    from roll_core.config.loader import mapping_value
    from roll_core.errors import ConfigError
    from roll_core.plugins import get_plugins

    env_cls = get_plugins().envs.get(args.env)
    options = mapping_value("--options", args.options)
    from roll_core.config import load_config

    # a model policy samples as the rollout does: its flags are checked as rollout's keys are, up front
    flags = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
             "top_k": args.top_k}
    sampling = load_config(None, [f"rollout.{key}={value}" for key, value in flags.items()]).rollout.sampling()
    from roll_core.config.loader import env_options_problems
    from roll_core.envs import build_env

    problems = env_options_problems("--options", args.env, options, get_plugins())
    if problems:
        raise ConfigError("; ".join(problems))
    env = build_env(env_cls, args.env, options, "--options")  # a value the constructor refuses: FrozenLake's size 1
    if args.model is not None:
        return _play_one(args, env, args.model, sampling)
    import tempfile
    from pathlib import Path

    from roll_core.config.schema import TinyModelConfig, TinyVisionConfig
    from roll_core.embedded.model import build_tiny_model

    # an environment that shows images needs the embedded model's image-text variant to tokenize them
    shape = TinyModelConfig(vision=TinyVisionConfig()) if env.image_observations else TinyModelConfig()
    with tempfile.TemporaryDirectory(prefix="roll-play-") as scratch:  # the embedded model, removed afterwards
        return _play_one(args, env, str(build_tiny_model(Path(scratch) / "model", shape)), sampling)


def _play_one(args, env, model: str, sampling: dict) -> int:
    """The episode of ``roll play`` against ``env``: ``model`` (a checkpoint directory) gives the
    tokenizer and, under ``--policy model``, the policy, which generates with ``sampling``."""
    from roll_core.agentic.episodes import TurnFormat, engine_policy, play, scripted_policy, transcript
    from roll_core.errors import ConfigError
    from roll_core.pipelines.runtime import load_tokenizer

    tokenizer = load_tokenizer(model)
    actions = [a for a in args.actions.split(",") if a]
    if args.policy == "model":
        from roll_core.config.schema import InferRoleConfig
        from roll_core.strategies.hf import HFInferStrategy

        engine = HFInferStrategy(model, InferRoleConfig(), seed=args.seed)
        policy = engine_policy(engine.generate, tokenizer.pad_token_id, **sampling)
    elif not actions:
        raise ConfigError(f"--policy {args.policy} needs --actions, e.g. --actions L,D,R,U")
    else:
        policy = scripted_policy(actions, tokenizer, randomly=args.policy == "random", seed=args.seed)
    (episode,) = play([env], [args.seed], [0], policy, tokenizer, max_turns=args.max_turns,
                      max_length=args.max_length, turn_format=TurnFormat(instruction=args.instruction))
    env.close()
    print(transcript(episode, tokenizer))
    return 0


OVERRIDES_HELP = """\
overrides are dotted keys with YAML values, applied after the file:
  executor=local              run every role in this process (no Ray)
  trainer.resume=never        start afresh even if output_dir holds checkpoints
  output_dir=runs/try2        where metrics, checkpoints and the summary go
  trainer.max_steps=20        a short run
  roles.actor_train.lr=1e-4   any key of the config (roll validate checks them)
quote values with spaces, brackets or braces for the shell:
  'trackers=[stdout, jsonl]'  "agentic.env_options={size: 6}"
environment variables:
  ROLL_DISABLE_PLUGINS=a,b    skip plugins by plugin or distribution name
  ROLL_STRICT_PLUGINS=1       a broken plugin stops roll instead of being reported and skipped
"""


def _version() -> str:
    import importlib.metadata as md
    import platform

    try:
        version = md.version("roll-core")
    except md.PackageNotFoundError:
        version = "unknown (not installed)"
    return f"roll-core {version} (Python {platform.python_version()})"


def _at_least(minimum: int | float):
    """An argparse type: a number of ``minimum``'s type, refused below it (``--limit -1`` would
    print all samples but the last, ``--max-turns 0`` still plays one)."""
    kind = type(minimum)

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="roll", description="roll: plugin-based RL post-training for LLMs",
                                     epilog=OVERRIDES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    documented: dict[str, Any] = {"epilog": OVERRIDES_HELP, "formatter_class": argparse.RawDescriptionHelpFormatter}

    run = sub.add_parser("run", help="run a pipeline (default: the embedded quickstart)",
                         description="Run a pipeline: the config file's, or with none the embedded quickstart "
                         "(the tiny model learning carry_addition).", **documented)
    run.add_argument("config", nargs="?", help="YAML config; omit for the built-in quickstart")
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.max_steps=10 (below)")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="keep the libraries' own output roll hides (transformers' load and save progress "
                     "bars, Ray's start-up warnings)")
    run.set_defaults(func=_cmd_run)

    val = sub.add_parser("validate", help="check a config without starting anything",
                         description="Check a config against the schema, the installed plugins and the "
                         "placement rules, as roll run does before any worker starts; nothing runs.", **documented)
    val.add_argument("config", nargs="?", help="YAML config; omit for the built-in quickstart, as `roll run` runs it")
    val.add_argument("overrides", nargs="*", help="dotted overrides applied after the file, as roll run takes them")
    val.set_defaults(func=_cmd_validate)

    lp = sub.add_parser("list-plugins", help="installed plugins and what they provide")
    lp.add_argument("--json", action="store_true", help="machine-readable output (plugins and every registered name)")
    lp.add_argument("-v", "--verbose", action="store_true", help="also list every registered name with its description")
    lp.set_defaults(func=_cmd_list_plugins)

    cp = sub.add_parser("check-plugin", help="run a plugin's contract checks on sample inputs")
    cp.add_argument("name", help="plugin name (as in list-plugins), distribution name, or a name it registered")
    cp.set_defaults(func=_cmd_check_plugin)

    plugin = sub.add_parser("plugin", help="write a new third-party plugin package (roll plugin new KIND NAME)")
    plugin_sub = plugin.add_subparsers(dest="plugin_command", metavar="SUBCOMMAND", required=True)
    new = plugin_sub.add_parser("new", help="a package with a working skeleton, its tests and a README",
                                description="Write roll-NAME/: a pyproject with the roll entry point, a skeleton "
                                "KIND registered as NAME that passes roll check-plugin, tests with roll's pytest "
                                "fixtures, and a README. Then: pip install -e roll-NAME[test]; pytest roll-NAME/tests.")
    new.add_argument("kind", choices=["reward", "env", "estimator", "loss", "tracker"], help="what the plugin provides")
    new.add_argument("name", help="the registered name, also the plugin's (a lowercase Python identifier)")
    new.add_argument("--dir", default=".", help="where to create roll-NAME/ (default: here)")
    new.set_defaults(func=_cmd_plugin_new)

    rep = sub.add_parser("report", help="PNG plots and one self-contained HTML page of one or more runs",
                         description="Plot reward, accuracy, KL, entropy, losses, response lengths, time per "
                         "phase, staleness and the train/inference gap of each run from its metrics.jsonl; several "
                         "runs overlay on one page, with the config keys in which they differ.")
    rep.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's output_dir (it has metrics.jsonl)")
    rep.add_argument("--out", help="where to write the PNGs and report.html (default: RUN_DIR/report for one "
                     "run, ./roll-report for several)")
    rep.set_defaults(func=_cmd_report)

    sr = sub.add_parser("show-rollouts", help="print a step's dumped samples (trainer.dump_rollouts_every)",
                        description="Print the samples a run dumped for one step: prompt, response (an episode's "
                        "turns), score, reward components, advantage, log-probs, version.")
    sr.add_argument("run", metavar="RUN_DIR")
    sr.add_argument("--step", type=int, help="the step (default: the last one dumped)")
    sr.add_argument("--limit", type=_at_least(0), default=8, help="samples to print (default 8; 0 = all)")
    sr.set_defaults(func=_cmd_show_rollouts)

    ep = sub.add_parser("export-pairs", help="write a run's dumped samples as preference pairs (JSON lines)",
                        description="For each dumped step of an rlvr or online_dpo run, pair each prompt's best- "
                        "and worst-scored answers (online_dpo: the pairs it trained on) and write them as rows with "
                        "prompt, chosen, rejected, both scores, ground_truth and step: a data.train_file for the dpo "
                        "and reward_model pipelines. Prompts whose answers all scored alike give no pair.")
    ep.add_argument("run", metavar="RUN_DIR")
    ep.add_argument("-o", "--output", required=True, help="the JSON-lines file to write")
    ep.add_argument("--steps", help="a step (12) or a range (11-13); default: every dumped step")
    ep.set_defaults(func=_cmd_export_pairs)

    rp = sub.add_parser("replay", help="train again on a run's dumped batches, without generating",
                        description="Load actor_train from the latest checkpoint before the first step asked for, "
                        "run the update on each dumped batch in this process, and print each step's recorded and "
                        "replayed loss and gradient norm. Exit status 1 when a gap exceeds --tolerance.")
    rp.add_argument("run", metavar="RUN_DIR")
    rp.add_argument("--steps", help="a step (12) or a range (11-13); default: the dumped steps after the latest "
                    "checkpoint before the last one dumped")
    rp.add_argument("--tolerance", type=_at_least(0.0), default=1e-5,
                    help="largest gap that counts as reproduced (1e-5)")
    rp.set_defaults(func=_cmd_replay)

    pl = sub.add_parser("play", help="play one episode of an environment in this process and print it")
    pl.add_argument("env", help="a registered environment (roll list-plugins)")
    pl.add_argument("--options", default="{}",
                    help="the environment's options, a YAML mapping as agentic.env_options takes: '{size: 6}'")
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--policy", choices=["scripted", "random", "model"], default="model",
                    help="scripted: --actions in order; random: drawn from --actions; model: --model generates")
    pl.add_argument("--actions", default="", help="comma-separated replies for scripted and random policies")
    pl.add_argument("--model", help="a Hugging Face model directory (default: the embedded tiny model, untrained)")
    pl.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (model policy)")
    pl.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, as rollout.top_p (model policy)")
    pl.add_argument("--top-k", type=int, default=0, help="top-k sampling, as rollout.top_k; 0 = off (model policy)")
    pl.add_argument("--max-new-tokens", type=int, default=8)
    pl.add_argument("--max-turns", type=_at_least(1), default=10)
    pl.add_argument("--max-length", type=_at_least(1), default=512,
                    help="tokens of the whole conversation (as agentic.max_length)")
    pl.add_argument("--instruction", default="", help="text before the first observation")
    pl.set_defaults(func=_cmd_play)
    return parser


def _cmd_report(args) -> int:
    from pathlib import Path

    from roll_core.report import PANELS, write_report

    out = Path(args.out) if args.out else Path(args.runs[0]) / "report" if len(args.runs) == 1 else Path("roll-report")
    page = write_report([Path(r) for r in args.runs], out)
    plots = sum((out / f"{panel.name}.png").exists() for panel in PANELS)
    print(f"wrote {page} and {plots} PNG plots in {out}")
    return 0


def _cmd_show_rollouts(args) -> int:
    from roll_core.pipelines.rollout_dump import show

    print(show(args.run, args.step, args.limit or None))
    return 0


def _cmd_export_pairs(args) -> int:
    from roll_core.pipelines.replay import parse_steps
    from roll_core.pipelines.rollout_dump import export_pairs, step_ranges

    count, steps = export_pairs(args.run, args.output, parse_steps(args.steps) if args.steps else None)
    print(f"{count} pairs from steps {step_ranges(steps)} -> {args.output}")
    return 0


def _cmd_replay(args) -> int:
    from roll_core.pipelines.replay import largest_gap, parse_steps, replay, report

    _quiet_libraries(False)  # transformers' load bars, as in roll run
    replayed = replay(args.run, parse_steps(args.steps) if args.steps else None)
    print(report(replayed))
    largest = largest_gap(replayed)
    if largest is not None and largest > args.tolerance:
        print(f"not reproduced: a gap above --tolerance={args.tolerance:g}", file=sys.stderr)
        return 1
    return 0


def _split_config_and_overrides(args) -> None:
    # `roll run key=value` (no file) must not take the first override for a file name.
    if getattr(args, "config", None) and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides = [args.config, *args.overrides]
        args.config = None


def _warn_unknown_disabled() -> None:
    """A name in ROLL_DISABLE_PLUGINS that matches no plugin disables nothing: say so, once, here in
    the command's own process (workers build their plugins too, and would repeat it)."""
    if not os.environ.get("ROLL_DISABLE_PLUGINS", "").strip():
        return
    from roll_core.plugins import get_plugins

    for name, hint in get_plugins().unknown_disabled():
        print(f"warning: ROLL_DISABLE_PLUGINS names '{name}', which no installed plugin or distribution has: "
              f"it disables nothing.{hint}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `roll`
        parser.print_help()
        return 0
    args.argv = sys.argv[1:] if argv is None else argv  # as typed, for "run this again to resume"
    _split_config_and_overrides(args)
    try:
        _warn_unknown_disabled()
        return args.func(args)
    except RollError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def console() -> NoReturn:
    """The ``roll`` command: :func:`main`, then exit with its code.

    Before exiting, one collection finalizes whatever is garbage by then, and ``gc.freeze()`` moves
    every object still alive out of the collector's sight. Otherwise the interpreter's own
    collections at exit walk the hundreds of thousands of objects that torch and transformers
    create: about 0.9 s of every command that imported them, against 0.3 s with these two calls
    (``benchmarks/bench_cli_exit.py``, docs/benchmarks.md). Objects alive at exit are still freed,
    threads are still joined and ``atexit`` handlers still run; only ``__del__`` of objects in
    cycles that are alive at exit is skipped, which Python never promised at exit.
    """
    code = main()
    gc.collect()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    console()
