"""The run configuration: pydantic v2 models, every one ``extra="forbid"``.

The defaults *are* the quickstart (the embedded tiny model on ``carry_addition``), so ``roll run``
with no file runs it; ``examples/quickstart.yaml`` spells the same values out. Names that refer to
registries (strategies, estimators, losses, rewards, ...) are plain strings here and are checked
against the installed plugins by :func:`roll_core.config.loader.check_registry_names` before any
worker starts.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from roll_core.embedded.model import TinyModelConfig


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Strict):
    path: str = Field("tiny", description="a Hugging Face model directory, or 'tiny' for the embedded model")
    tiny: TinyModelConfig = TinyModelConfig()


class DataConfig(Strict):
    dataset: str = Field("carry_addition", description="registered dataset name (ignored when train_file is set)")
    options: dict[str, Any] = Field(default_factory=dict, description="options of the registered dataset")
    train_file: str | None = Field(None, description="JSONL rows with prompt, ground_truth[, demonstration, domain]")
    eval_file: str | None = None
    eval_size: int | None = Field(None, ge=1, description="evaluate on the first N held-out rows only")


class WarmupConfig(Strict):
    """Supervised warm-up on the data's demonstrations before RL (0 steps disables it)."""

    steps: int = Field(500, ge=0)
    lr: float = Field(1e-3, gt=0)
    batch_size: int = Field(64, ge=1)


class RolloutConfig(Strict):
    scheduler: str = "sync"
    prompts_per_step: int = Field(32, ge=1)
    num_return_sequences: int = Field(8, ge=1, description="group size")
    max_new_tokens: int = Field(8, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)


class AlgorithmConfig(Strict):
    advantage_estimator: str = "grpo"
    policy_loss: str = "ppo_clip"
    kl_estimator: str = "k3"
    kl_loss_coef: float = Field(0.0, ge=0, description="weight of the KL(actor || reference) loss term")
    entropy_coef: float = 0.0
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.2, ge=0)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    norm_adv_by_std: bool = Field(True, description="GRPO: divide by the group std (False = Dr. GRPO)")
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    ppo_epochs: int = Field(1, ge=1)
    max_grad_norm: float = Field(1.0, gt=0)


class TrainRoleConfig(Strict):
    strategy: str = "hf"
    num_workers: int = Field(1, ge=1, le=1, description="data-parallel training across workers is not available yet")
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    micro_batch_size: int = Field(64, ge=1)


class InferRoleConfig(Strict):
    strategy: str = "hf"
    num_workers: int = Field(1, ge=1)


class RewardRoleConfig(Strict):
    name: str = "exact_match"
    options: dict[str, Any] = Field(default_factory=dict)
    num_workers: int = Field(1, ge=1)


class RolesConfig(Strict):
    actor_train: TrainRoleConfig = TrainRoleConfig()
    actor_infer: InferRoleConfig = InferRoleConfig()
    reference: InferRoleConfig | None = Field(
        InferRoleConfig(), description="frozen copy of the initial policy; null disables it (no KL)"
    )
    reward: RewardRoleConfig = RewardRoleConfig()


class TrainerConfig(Strict):
    max_steps: int = Field(200, ge=0)
    eval_every: int = Field(50, ge=0, description="0 = only before and after RL")
    save_every: int = Field(50, ge=0, description="0 = only at the end")
    keep_checkpoints: int = Field(2, ge=1)
    resume: Literal["auto", "never"] = Field("auto", description="auto: continue from the latest checkpoint in output_dir")


class RayConfig(Strict):
    address: str | None = Field(None, description="join this cluster; None starts a local one")
    num_cpus: int | None = Field(None, ge=1)


class RollConfig(Strict):
    exp_name: str = "quickstart"
    output_dir: str = Field("runs/quickstart", description="checkpoints, metrics and logs of the run")
    seed: int = 42
    pipeline: str = "rlvr"
    executor: Literal["ray", "local"] = "ray"
    torch_threads: int = Field(2, ge=1, description="intra-op threads of every worker (same in both executors)")
    ray: RayConfig = RayConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    warmup: WarmupConfig = WarmupConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    roles: RolesConfig = RolesConfig()
    trainer: TrainerConfig = TrainerConfig()
    trackers: list[str] = Field(default_factory=lambda: ["stdout", "jsonl", "tensorboard"])

    @model_validator(mode="after")
    def _cross_checks(self):
        if self.algorithm.kl_loss_coef > 0 and self.roles.reference is None:
            raise ValueError("algorithm.kl_loss_coef > 0 needs a reference role (roles.reference is null)")
        return self
