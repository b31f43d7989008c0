"""RL algorithms as small registered functions: advantages, policy losses, KL estimators, aggregation.

Each function documents its formula, paper and tensor shapes (``B`` rows, ``R`` response tokens).
They are registered by name in :mod:`roll_core.default_plugins.algorithms`; a plugin adds its own
through the same hooks and the config picks it by name.
"""
