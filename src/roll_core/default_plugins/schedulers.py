"""Built-in rollout schedulers."""

from roll_core.hookspecs import hookimpl


@hookimpl
def roll_register_schedulers(register):
    register("sync", "roll_core.rollout.sync:SyncRolloutScheduler", description="generate the step's groups, scoring each request as it finishes")
    register("async", "roll_core.rollout.async_scheduler:AsyncRolloutScheduler",
             overlaps_training=True,
             description="generation runs on while the policy trains, staleness bounded by async_generation_ratio")
