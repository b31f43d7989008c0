"""Built-in pipelines."""

from roll_core.hookspecs import hookimpl


@hookimpl
def roll_register_pipelines(register):
    register("rlvr", "roll_core.pipelines.rlvr:RLVRPipeline", description="RL with verifiable rewards")
    register("sft", "roll_core.pipelines.sft:SFTPipeline",
             description="supervised fine-tuning on demonstrations (rlvr's warm-up, on its own)")
    register("dpo", "roll_core.pipelines.dpo:DPOPipeline",
             description="direct preference optimisation on (prompt, chosen, rejected) pairs (DPO, IPO, ...)")
    register("online_dpo", "roll_core.pipelines.online_dpo:OnlineDPOPipeline",
             description="DPO on pairs the policy samples each step, the best- and worst-scored by the run's reward")
    register("reward_model", "roll_core.pipelines.reward_model:RewardModelPipeline",
             description="a reward model (the critic's score head) trained on preference pairs (Bradley-Terry)")
    register("agentic", "roll_core.pipelines.agentic:AgenticPipeline",
             description="multi-turn episodes of a registered environment (agentic_reinforce, gigpo)")
    register("distill", "roll_core.pipelines.distill:DistillPipeline",
             description="knowledge distillation from a teacher role (forward/reverse/skewed/adaptive KL, JSD, top-k)")
