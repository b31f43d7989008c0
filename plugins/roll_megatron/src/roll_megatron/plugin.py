"""The hook roll discovers through the ``roll`` entry point: ``megatron`` for the policy (train, with
LoRA), for PPO's critic (with LoRA), and for a frozen reference's log-probs (infer, ``generates=False``)."""

from roll_core import hookimpl

REQUIRES = {"megatron.core": "pip install roll-megatron (it depends on megatron-core)"}
OPTIONS = "roll_megatron.options:MegatronOptions"


@hookimpl
def roll_register_strategies(register):
    register("megatron", "roll_megatron.strategy:MegatronTrainStrategy", kind="train", lora=True, packed_sequences=True,
             description="Megatron-Core GPT (Llama/Qwen2): tensor, pipeline and data parallelism; LoRA",
             requires=REQUIRES, options=OPTIONS)
    register("megatron", "roll_megatron.strategy:MegatronCriticStrategy", kind="critic", lora=True,
             packed_sequences=True,
             description="Megatron-Core GPT (Llama/Qwen2) with a value head: tensor, pipeline and data parallelism; "
             "LoRA",
             requires=REQUIRES, options=OPTIONS)
    register("megatron", "roll_megatron.strategy:MegatronReferenceStrategy", kind="infer", generates=False,
             packed_sequences=True,
             description="Megatron-Core GPT log-probs for roles.reference, sharded like the policy (no generation)",
             requires=REQUIRES, options=OPTIONS)
