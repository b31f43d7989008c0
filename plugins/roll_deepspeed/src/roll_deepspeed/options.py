"""``roles.<role>.strategy_options`` of the ``deepspeed`` strategies, checked by ``roll validate``
before any worker starts (an unknown key is named, with a did-you-mean).

The usual settings are fields here; any other key of DeepSpeed's ``zero_optimization`` section goes
in ``zero_config`` and is checked against the installed DeepSpeed's ``DeepSpeedZeroConfig``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# zero_optimization keys that an option of this model sets.
_OWN_ZERO_KEYS = {"stage": "zero_stage", "offload_optimizer": "offload_optimizer", "offload_param": "offload_params"}


class DeepSpeedOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    zero_stage: Literal[1, 2, 3] = Field(
        2, description="1: optimizer states sharded; 2: and gradients; 3: and parameters")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16 trains in bfloat16 with fp32 master weights in the optimizer")
    offload_optimizer: bool = Field(
        False, description="ZeRO-Offload: optimizer states and the optimizer step in host memory")
    offload_params: bool = Field(False, description="parameters in host memory between uses (zero_stage 3 only)")
    zero_config: dict[str, Any] = Field(default_factory=dict,
                                        description="any other key of DeepSpeed's zero_optimization section")

    @model_validator(mode="after")
    def _param_offload_needs_stage_3(self) -> DeepSpeedOptions:
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"offload_params needs zero_stage 3 (got zero_stage {self.zero_stage}): only stage 3 "
                             "shards, and so can offload, the parameters")
        return self

    def check_role(self, role_config) -> list[str]:
        """Settings of the role these options do not fit."""
        if getattr(role_config, "compile", False) and self.zero_stage == 3:
            # ZeRO-3 gathers each linear layer's parameters in hooks on the layer, inside the decoder
            # layer that compile_layers compiles: TorchDynamo traces into them and recompiles per
            # module until it gives up and runs them eagerly (measured on the tiny model).
            return ["compile: true needs zero_stage 1 or 2: ZeRO-3 gathers each linear layer's parameters in "
                    "hooks inside the decoder layers that would be compiled; set zero_stage: 2 or compile: false"]
        return []

    @field_validator("zero_config")
    @classmethod
    def _known_zero_keys(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not value:
            return value
        from roll_core.strategies.engines import check_engine_args

        try:
            from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        except ImportError:  # roll validate reports the missing package
            return value
        known = {name for name, f in DeepSpeedZeroConfig.model_fields.items()}
        known |= {f.alias for f in DeepSpeedZeroConfig.model_fields.values() if f.alias}
        return check_engine_args(value, known, _OWN_ZERO_KEYS, "DeepSpeed zero_optimization", field="zero_config")

    def deepspeed_config(self, on_gpu: bool) -> dict[str, Any]:
        """The DeepSpeed config these options stand for.

        roll's updater splits mini-batches into micro-batches itself and calls ``step`` once per
        mini-batch, so DeepSpeed's own accumulation is unmanaged: backward only accumulates, and the
        step is the boundary where gradients are reduced, clipped and applied. The batch sizes below
        are the ones DeepSpeed requires to be consistent, nothing reads them. Clipping is set per
        step (``max_grad_norm`` comes with each update)."""
        zero: dict[str, Any] = {"stage": self.zero_stage, **self.zero_config}
        offload = {"device": "cpu", "pin_memory": on_gpu}
        if self.offload_optimizer:
            zero["offload_optimizer"] = offload
        if self.offload_params:
            zero["offload_param"] = offload
        return {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
            "gradient_clipping": 1.0,
            "zero_optimization": zero,
            "bf16": {"enabled": self.precision == "bf16"},
            "zero_allow_untested_optimizer": True,  # torch's AdamW, the optimizer of roll's other backends
            "zero_force_ds_cpu_optimizer": False,  # ... also when offloaded (DeepSpeed's CPU Adam needs a compiler)
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
