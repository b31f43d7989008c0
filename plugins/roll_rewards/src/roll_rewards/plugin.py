"""Registration only: targets are lazy strings, so listing plugins imports neither sympy nor math-verify."""

from roll_core import hookimpl


@hookimpl
def roll_register_rewards(register):
    register("math_verify", "roll_rewards.math:MathVerifyReward",
             description="symbolic equivalence of the final answer (math-verify), with timeouts")
    register("code", "roll_rewards.code:CodeReward",
             description="runs the response's program against tests (stdio / assert / pytest) in a sandbox")
