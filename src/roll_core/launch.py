"""Running a job from Python: what ``roll run`` does, for notebooks, scripts and sweeps.

    import roll_core

    summary = roll_core.run("examples/quickstart.yaml", ["trainer.max_steps=20"])
    print(summary["after_rl"]["eval/accuracy"])      # rlvr: held-out accuracy after RL

Why. A researcher iterating in a notebook wants the run's summary back as a value and a reward
written in the cell next to it, not a shell command and a package to install. ``roll run`` is a thin
layer over :func:`run`, so both check the config the same way before any worker starts, start and
stop the same executors, and write the same run directory (``metrics.jsonl``, checkpoints,
``summary.json``); a second call with the same ``output_dir`` resumes as ``roll run`` does.

In-process plugins. ``plugins={"name": obj}`` registers hook implementations defined in this
process (a module, a class or an instance with ``@roll_core.hookimpl`` functions) next to the
installed ones, for this call only. Ray's workers are other processes that build their registries
from installed packages, so such a run needs ``executor=local``; for Ray, install the plugin as a
package (``roll plugin new``), which every worker then finds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from roll_core.errors import ConfigError

# After Ctrl-C, seconds the workers in other processes get to close (an idle one closes at once; a
# busy one would first finish its call, which the user just interrupted) before their processes end.
INTERRUPTED_CLOSE_S = 2.0


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run`, raised after every worker stopped: the ``phase`` it stopped in and
    ``resume_from``, the checkpoint (or "the start") that running the same config again resumes from."""

    def __init__(self, phase: str, resume_from: str):
        super().__init__(f"interrupted during {phase}; running the same config again resumes from {resume_from}")
        self.phase, self.resume_from = phase, resume_from


def run(config: str | Path | None = None, overrides: Sequence[str] = (), *,
        plugins: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run the job of ``config`` (a YAML file; None for the embedded default) with dotted
    ``overrides`` (``"trainer.max_steps=20"``) to its end, and return its summary, the dict its
    ``summary.json`` holds (rlvr: ``steps``, ``before_rl`` and ``after_rl`` evaluations, ``restarts``).

    Everything is checked first: a bad key or an unknown name raises :class:`~roll_core.errors.ConfigError`
    before any worker starts. Ctrl-C stops every worker and raises :class:`RunInterrupted`.
    ``plugins`` adds in-process plugins by name for this call (the module docstring)."""
    if isinstance(overrides, str):
        raise TypeError(f"overrides is a list of 'key=value' strings, got the string {overrides!r}")
    if not plugins:
        return _run_checked(config, list(overrides), in_process=[])
    from roll_core.plugins import plugins_added

    with plugins_added(list(plugins.items())):
        return _run_checked(config, list(overrides), in_process=sorted(plugins))


def _run_checked(config, overrides: list[str], in_process: list[str]) -> dict[str, Any]:
    from roll_core.config import load_and_check
    from roll_core.plugins import get_plugins
    from roll_core.runtime import make_executor
    from roll_core.runtime.controller import HostedRun
    from roll_core.runtime.cpu_share import warn_if_cores_busy
    from roll_core.runtime.placement import controller_in_worker

    cfg = load_and_check(config, overrides)  # everything is checked before a worker starts
    if in_process and cfg.executor != "local":
        raise ConfigError(f"in-process plugins ({', '.join(in_process)}) reach only this process, and executor "
                          f"'{cfg.executor}' runs workers in others: pass executor=local, or install them as a "
                          f"package (roll plugin new) so that every worker finds them")
    print(describe_run(cfg), flush=True)
    warn_if_cores_busy(cfg)  # measured before any worker adds its own load
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the driver tokenizes, then forks workers
    pipeline_cls = get_plugins().pipelines.get(cfg.pipeline)
    pipeline, interrupted = None, False
    try:
        executor = make_executor(cfg)
        try:
            # a run whose roles all live in one Ray worker runs its pipeline there (ray.colocate_controller)
            pipeline = (HostedRun if controller_in_worker(cfg) else pipeline_cls)(cfg, executor)
            return pipeline.run()
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            # every worker stops, on Ctrl-C too, when a worker still busy is not waited for to close
            executor.shutdown(close_within=INTERRUPTED_CLOSE_S if interrupted else None)
    except KeyboardInterrupt:
        if pipeline is None:
            raise RunInterrupted("start-up", "the start") from None
        raise RunInterrupted(pipeline.phase, pipeline.resume_hint()) from None


def describe_run(config) -> str:
    """The line ``roll run`` starts with: what runs, on what, scored or played how, and where it writes."""
    from roll_core.pipelines import pipeline_class

    task = pipeline_class(config).describe_task(config)
    compiled = config.compiled_roles()
    # compiling takes tens of seconds in the first pass, which would otherwise look like a hang
    compiling = f", compiling {' and '.join(compiled)} in the first pass" if compiled else ""
    from roll_core.runtime.placement import controller_in_worker

    executor = config.executor + (" (the controller inside its one worker)" if controller_in_worker(config) else "")
    return (f"roll run: pipeline {config.pipeline}, model {config.model.path}, {task}, executor {executor}, "
            f"{pipeline_class(config).planned_steps(config)} steps{compiling} -> {config.output_dir}")
