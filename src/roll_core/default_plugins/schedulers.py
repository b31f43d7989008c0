"""Built-in rollout schedulers."""

from roll_core.hookspecs import hookimpl


@hookimpl
def roll_register_schedulers(register):
    register("sync", "roll_core.rollout.sync:SyncRolloutScheduler", description="generate all groups, then score")
