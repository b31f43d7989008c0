"""``roles.<role>.strategy_options`` of the ``megatron`` strategy, checked by ``roll validate`` before
any worker starts: names (with a did-you-mean), values, and the parallel layout against the role's
workers (``tensor_parallel_size x pipeline_parallel_size`` must divide ``num_workers``; the quotient
is the data-parallel size), and LoRA's settings the strategy supports (no adapter dropout)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class MegatronOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int = Field(1, ge=1, description="ranks that split every layer's matrices (and the "
                                      "vocabulary); must divide the attention heads, key/value heads and vocabulary")
    pipeline_parallel_size: int = Field(1, ge=1, description="stages that split the layers; must divide the number "
                                        "of layers")

    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: forward and backward passes under torch.autocast in bfloat16 (matrix products); "
        "weights, gradients and AdamW's moments stay float32, as the hf strategy's bf16")
    distributed_optimizer: bool = Field(False, description="shard the optimizer states (AdamW's moments) over the "
                                        "data-parallel ranks, as Megatron's distributed optimizer does: each rank "
                                        "updates its share of the parameters and broadcasts them")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def check_role(self, role_config) -> list[str]:
        problems, workers = [], role_config.num_workers
        if workers % self.model_parallel_size:
            problems.append(f"tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                            f"{self.pipeline_parallel_size} = {self.model_parallel_size} does not divide the role's "
                            f"{workers} workers (num_workers); the data-parallel size is num_workers / that product")
        lora = getattr(role_config, "lora", None)
        if lora is not None and lora.dropout > 0:  # one mask on every tensor-parallel rank: not built yet
            role = "critic" if role_config.kind == "critic" else "actor_train"  # the trained roles with lora
            problems.append(f"key 'roles.{role}.lora.dropout': the megatron strategy trains LoRA without "
                            f"dropout (got {lora.dropout}; set 0, or use the hf, fsdp2 or deepspeed strategy)")
        return problems
