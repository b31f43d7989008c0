"""The hook roll discovers through the ``roll`` entry point: one inference strategy, ``sglang``."""

from roll_core import hookimpl


@hookimpl
def roll_register_strategies(register):
    register("sglang", "roll_sglang.strategy:SGLangInferStrategy", kind="infer",
             description="SGLang engine: continuous batching with sampled-token log-probs, weights updated in place",
             requires={"sglang": "pip install 'roll-sglang[engine]' (CUDA only)"},
             options="roll_sglang.options:SGLangOptions")
