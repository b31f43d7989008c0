"""``roles.<role>.strategy_options`` of the ``sglang`` strategy: the engine's arguments.

Checked by ``roll validate`` before any worker starts. The common ``sglang.Engine`` arguments are
fields here; any other ``ServerArgs`` field goes in ``engine_args`` (checked against the installed
SGLang's ``ServerArgs`` where SGLang imports).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SGLangOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "bfloat16", description="weights and activations (float32 for log-probs equal to an fp32 trainer's)")
    context_length: int | None = Field(None, ge=1, description="prompt + response tokens; None = the model's own")
    mem_fraction_static: float = Field(0.5, gt=0, le=1, description="share of GPU memory for weights and KV cache")
    enable_radix_cache: bool = Field(True, description="prefix caching: a prompt's KV is shared by its samples")
    tp_size: int = Field(1, ge=1, description="tensor-parallel GPUs per engine")
    release_on_offload: bool = Field(
        True, description="colocation: release weights and KV cache while the trainer runs (enable_memory_saver)")
    engine_args: dict[str, Any] = Field(default_factory=dict, description="any other sglang ServerArgs field")

    @field_validator("engine_args")
    @classmethod
    def _known_server_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not value:
            return value
        import dataclasses

        from roll_core.strategies.engines import check_engine_args

        try:
            from sglang.srt.server_args import ServerArgs
        except ImportError:  # the engine is checked again when a worker starts it
            return value
        return check_engine_args(value, {f.name for f in dataclasses.fields(ServerArgs)},
                                 {"dtype", "context_length", "mem_fraction_static", "tp_size"}, "SGLang server")

    def engine_kwargs(self, model_path: str, seed: int) -> dict[str, Any]:
        """Keyword arguments of ``sglang.Engine``."""
        return dict(model_path=model_path, dtype=self.dtype, random_seed=seed, context_length=self.context_length,
                    mem_fraction_static=self.mem_fraction_static, disable_radix_cache=not self.enable_radix_cache,
                    tp_size=self.tp_size, enable_memory_saver=self.release_on_offload,
                    skip_tokenizer_init=True,  # roll sends and receives token ids
                    **self.engine_args)
