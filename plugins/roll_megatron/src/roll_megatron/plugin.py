"""The hook roll discovers through the ``roll`` entry point: ``megatron`` for the policy."""

from roll_core import hookimpl


@hookimpl
def roll_register_strategies(register):
    register("megatron", "roll_megatron.strategy:MegatronTrainStrategy", kind="train",
             description="Megatron-Core GPT (Llama/Qwen2): tensor, pipeline and data parallelism",
             requires={"megatron.core": "pip install roll-megatron (it depends on megatron-core)"},
             options="roll_megatron.options:MegatronOptions")
