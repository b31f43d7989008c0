"""Registration only: targets are lazy strings, so listing plugins imports no gymnasium."""

from roll_core import hookimpl


@hookimpl
def roll_register_envs(register):
    register("frozen_lake", "roll_envs.frozen_lake:FrozenLake",
             description="gymnasium's FrozenLake as text: a map per seed, moves L/D/R/U, reward 1 at the goal")
