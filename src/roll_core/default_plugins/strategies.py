"""Built-in strategies: ``hf`` (transformers + torch) for training and inference; ``fsdp2``
(the ``hf`` trainer and critic sharded with torch's ``fully_shard``) for data-parallel training."""

from roll_core.hookspecs import hookimpl


_OPTIONS = "roll_core.strategies.precision:TorchOptions"  # strategy_options.precision: fp32 | bf16
_INFER_OPTIONS = "roll_core.strategies.cuda_graph:InferOptions"  # those and strategy_options.cuda_graphs


@hookimpl
def roll_register_strategies(register):
    register("hf", "roll_core.strategies.hf:HFTrainStrategy", kind="train", lora=True, packed_sequences=True,
             compiles=True, images=True, options=_OPTIONS,
             description="transformers + torch, AdamW (full or LoRA adapters), one process, fp32 or bf16 autocast")
    register("hf", "roll_core.strategies.hf:HFInferStrategy", kind="infer", packed_sequences=True, images=True,
             options=_INFER_OPTIONS,
             description="transformers + torch, KV-cached sampling (CUDA graphs on a GPU), fp32 or bf16 autocast")
    register("hf", "roll_core.strategies.hf:HFCriticStrategy", kind="critic", lora=True, packed_sequences=True,
             compiles=True, images=True, options=_OPTIONS,
             description="transformers token-classification head (one value per token), AdamW (full or LoRA)")
    register("fsdp2", "roll_core.strategies.fsdp2:FSDP2TrainStrategy", kind="train", lora=True, packed_sequences=True,
             compiles=True, images=True, options=_OPTIONS,
             description="transformers + torch FSDP2 (fully_shard) over the role's workers, AdamW")
    register("fsdp2", "roll_core.strategies.fsdp2:FSDP2CriticStrategy", kind="critic", lora=True, packed_sequences=True,
             compiles=True, images=True, options=_OPTIONS,
             description="the hf critic's value model sharded with torch FSDP2 (fully_shard), AdamW")
