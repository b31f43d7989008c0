"""roll-core: the lean core of roll, a plugin-based SDK for RL post-training of language models.

Plugins implement the hooks in :mod:`roll_core.hookspecs` with ``@roll_core.hookimpl``::

    from roll_core import hookimpl

    @hookimpl
    def roll_register_rewards(register):
        register("my_reward", "my_pkg.rewards:MyReward")

Jobs run from Python as ``roll run`` runs them::

    import roll_core
    summary = roll_core.run("examples/quickstart.yaml", ["trainer.max_steps=20"])
"""

from typing import Any

from roll_core.hookspecs import hookimpl

__all__ = ["hookimpl", "run", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # run() imports the config, the runtime and torch; a plugin that imports roll_core for
    # hookimpl alone should not pay for them
    if name == "run":
        from roll_core.launch import run

        return run
    raise AttributeError(f"module 'roll_core' has no attribute {name!r}")
