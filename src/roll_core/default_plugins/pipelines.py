"""Built-in pipelines."""

from roll_core.hookspecs import hookimpl


@hookimpl
def roll_register_pipelines(register):
    register("rlvr", "roll_core.pipelines.rlvr:RLVRPipeline", description="RL with verifiable rewards")
