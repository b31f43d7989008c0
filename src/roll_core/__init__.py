"""roll-core: the lean core of roll, a plugin-based SDK for RL post-training of language models.

Plugins implement the hooks in :mod:`roll_core.hookspecs` with ``@roll_core.hookimpl``::

    from roll_core import hookimpl

    @hookimpl
    def roll_register_rewards(register):
        register("my_reward", "my_pkg.rewards:MyReward")
"""

from roll_core.hookspecs import hookimpl

__all__ = ["hookimpl", "__version__"]
__version__ = "0.1.0"
