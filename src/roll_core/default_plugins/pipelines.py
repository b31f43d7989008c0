"""Built-in pipelines."""

from roll_core.hookspecs import hookimpl


@hookimpl
def roll_register_pipelines(register):
    register("rlvr", "roll_core.pipelines.rlvr:RLVRPipeline", description="RL with verifiable rewards")
    register("sft", "roll_core.pipelines.sft:SFTPipeline",
             description="supervised fine-tuning on demonstrations (rlvr's warm-up, on its own)")
