"""Registration only. The target is a lazy "module:attribute" string, so `roll list-plugins`
shows the reward without importing it."""

from roll_core import hookimpl


@hookimpl
def roll_register_rewards(register):
    register("numeric_closeness", "roll_numeric_reward.reward:NumericCloseness",
             description="1 for the exact number, partial credit that decays with the distance")
