"""Built-in strategies: ``hf`` (transformers + torch) for training and inference; ``fsdp2``
(the ``hf`` trainer sharded with torch's ``fully_shard``) for data-parallel training."""

from roll_core.hookspecs import hookimpl


@hookimpl
def roll_register_strategies(register):
    register("hf", "roll_core.strategies.hf:HFTrainStrategy", kind="train", lora=True, packed_sequences=True,
             compiles=True, description="transformers + torch, AdamW (full or LoRA adapters), one process")
    register("hf", "roll_core.strategies.hf:HFInferStrategy", kind="infer", packed_sequences=True,
             description="transformers + torch, KV-cached sampling")
    register("hf", "roll_core.strategies.hf:HFCriticStrategy", kind="critic", packed_sequences=True,
             compiles=True, description="transformers token-classification head (one value per token), AdamW")
    register("fsdp2", "roll_core.strategies.fsdp2:FSDP2TrainStrategy", kind="train", packed_sequences=True,
             compiles=True, description="transformers + torch FSDP2 (fully_shard) over the role's workers, AdamW")
