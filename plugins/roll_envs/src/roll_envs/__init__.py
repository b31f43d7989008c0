"""roll-envs: environments for agentic RL with roll (registered through ``roll_register_envs``)."""
