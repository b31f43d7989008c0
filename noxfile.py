"""Developer sessions: `nox -s tests`, `nox -s plugin`, `nox -s example_plugin`, `nox -s lint`, `nox -s quickstart`.

Each package is installed alone into its own session venv, which catches undeclared dependencies.
torch is installed first from its pinned CPU build so no session pulls a CUDA wheel.
"""

import nox

nox.options.sessions = ["lint", "tests", "plugin", "example_plugin"]
TORCH = "torch==2.13.0"


@nox.session
def tests(session):
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", "-q", *session.posargs)


@nox.session
@nox.parametrize("plugin", ["roll_rewards"])
def plugin(session, plugin):
    """One plugin installed alone on top of roll-core, running its own tests."""
    session.install(TORCH)
    session.install("-e", ".[test]", "-e", f"plugins/{plugin}")
    session.run("pytest", "-q", f"plugins/{plugin}/tests", *session.posargs)


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
