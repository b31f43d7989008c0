"""Built-in rewards."""

from roll_core.hookspecs import hookimpl


@hookimpl
def roll_register_rewards(register):
    register("exact_match", "roll_core.rewards:ExactMatch", description="1 if response == ground truth")
