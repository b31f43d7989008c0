"""Registration only: targets are lazy strings, so listing plugins imports no gymnasium."""

from roll_core import hookimpl


@hookimpl
def roll_register_envs(register):
    register("frozen_lake", "roll_envs.frozen_lake:FrozenLake",
             description="gymnasium's FrozenLake as text: a map per seed, moves L/D/R/U, reward 1 at the goal")
    register("gymnasium", "roll_envs.gymnasium_text:GymnasiumText",
             description="any gymnasium environment with discrete actions, as text (option id: CliffWalking-v1, ...)")
    register("sokoban", "roll_envs.sokoban:Sokoban",
             description="Sokoban as text: a solvable room per seed, push every box onto a target")
    register("tool_use", "roll_envs.tool_use:ToolUse",
             description="answer arithmetic with a calculator or sandboxed Python (roll-envs[tools] for python)")
