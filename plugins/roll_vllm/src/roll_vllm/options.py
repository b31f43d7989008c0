"""``roles.<role>.strategy_options`` of the ``vllm`` strategy: the engine's arguments.

Checked by ``roll validate`` before any worker starts (an unknown key is named, with a did-you-mean).
The common arguments are fields here; any other ``vllm.EngineArgs`` field goes in ``engine_args``,
whose keys are checked against the installed vLLM's ``EngineArgs``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class VLLMOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="weights and activations; float32 matches the hf trainer's log-probs to 1e-5")
    max_model_len: int | None = Field(None, ge=1, description="prompt + response tokens; None = the model's own limit")
    enable_prefix_caching: bool = Field(True, description="reuse the KV cache of a shared prompt across its samples")
    enforce_eager: bool = Field(True, description="no CUDA graphs: faster start, what small models want")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="share of GPU memory for weights and KV cache")
    cpu_kv_cache_gib: int = Field(1, ge=1, description="KV cache size on the CPU build (VLLM_CPU_KVCACHE_SPACE)")
    max_num_seqs: int = Field(256, ge=1, description="sequences decoded together (continuous batching)")
    tensor_parallel_size: int = Field(1, ge=1)
    partial_rollout: bool = Field(
        False, description="a weight update interrupts running requests instead of waiting for them; they "
        "continue on the new weights (KV re-computed), keeping the tokens already sampled")
    engine_args: dict[str, Any] = Field(default_factory=dict, description="any other vllm.EngineArgs field")

    @field_validator("engine_args")
    @classmethod
    def _known_engine_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not value:
            return value
        import dataclasses

        from roll_core.strategies.engines import check_engine_args

        try:
            from vllm.engine.arg_utils import EngineArgs
        except ImportError:  # checked again when the engine starts; roll validate reports the missing engine
            return value
        return check_engine_args(value, {f.name for f in dataclasses.fields(EngineArgs)},
                                 set(cls.model_fields) - {"engine_args"}, "vLLM engine")
