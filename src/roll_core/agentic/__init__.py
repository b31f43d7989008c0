"""Agentic, multi-turn RL: episodes played against environments (:mod:`roll_core.envs`) become
training rows the multi-turn estimators read (:mod:`roll_core.agentic.samples`)."""
