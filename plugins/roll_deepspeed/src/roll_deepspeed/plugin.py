"""The hook roll discovers through the ``roll`` entry point: ``deepspeed`` for the policy and the critic."""

from roll_core import hookimpl

_REQUIRES = {"deepspeed": "pip install roll-deepspeed (it depends on deepspeed)"}


@hookimpl
def roll_register_strategies(register):
    register("deepspeed", "roll_deepspeed.strategy:DeepSpeedTrainStrategy", kind="train", packed_sequences=True,
             lora=True, images=True, compiles=True,
             description="DeepSpeed ZeRO stages 1-3 (optimizer/parameter offload, fp32 or bf16)",
             requires=_REQUIRES, options="roll_deepspeed.options:DeepSpeedOptions")
    register("deepspeed", "roll_deepspeed.strategy:DeepSpeedCriticStrategy", kind="critic", packed_sequences=True,
             lora=True, images=True, compiles=True, description="PPO's value model on DeepSpeed ZeRO", requires=_REQUIRES,
             options="roll_deepspeed.options:DeepSpeedOptions")
