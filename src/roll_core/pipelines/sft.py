"""``sft``: supervised fine-tuning on the data's demonstrations, and ``rlvr``'s warm-up.

Each step takes ``warmup.batch_size`` rows that carry a ``demonstration`` (in a seeded, resumable
order), and minimises the cross-entropy of the demonstration (plus EOS) after the prompt, on
actor_train, data-parallel over its workers. The held-out loss uses each held-out row's
``demonstration`` as the target, or its ``ground_truth`` when it has none. The settings are the
``warmup`` section's, so ``rlvr``'s warm-up and a standalone run are the same training.

It is the shortest pipeline on the runtime (:mod:`roll_core.pipelines.runtime`): build one role and
say what a step and an evaluation are (``ActorLoop`` keeps the checkpoint and the summary of the
pipelines that train actor_train alone). Run it alone::

    roll run pipeline=sft warmup.steps=300 trainer.eval_every=100
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

from roll_core.algorithms.objective import SupervisedObjective
from roll_core.data import Batch, PromptStream
from roll_core.errors import ConfigError
from roll_core.files import replace_dir
from roll_core.pipelines.batches import demonstration_batch, packed_demonstration_batch
from roll_core.pipelines.runtime import SEED_OFFSETS, ActorLoop, log_probs, save_tokenizer, start_update
from roll_core.pipelines.sources import load_rows
from roll_core.runtime.executor import WorkerGroup
from roll_core.trackers import progress_bar
from roll_core.training import UpdateSpec


class DemonstrationSource:
    """Batches of ``warmup.batch_size`` rows that carry a demonstration, in a seeded, resumable order
    (``stream``), padded or packed as ``warmup.packing`` says."""

    def __init__(self, tokenizer, rows: list[dict], config, multiple_of: int = 1):
        demonstrated = [r for r in rows if r.get("demonstration") is not None]
        if not demonstrated:
            raise ConfigError("warmup.steps > 0 but no training row has a 'demonstration'; set warmup.steps=0")
        self.tokenizer, self.settings, self.multiple_of = tokenizer, config.warmup, multiple_of
        self.stream = PromptStream(demonstrated, config.seed + SEED_OFFSETS["warmup_data"])

    def __call__(self) -> Batch:
        rows = self.stream.next(self.settings.batch_size)
        if self.settings.packing:
            return packed_demonstration_batch(self.tokenizer, rows, self.settings.max_length, self.multiple_of)
        return demonstration_batch(self.tokenizer, rows)


class SupervisedTrainer:
    """Supervised steps on ``actor``, each on the next batch of ``batches`` (a
    :class:`DemonstrationSource`, or the agentic pipeline's teacher episodes)."""

    def __init__(self, executor, actor: WorkerGroup, tokenizer, config, batches: Callable[[], Batch]):
        self.executor, self.actor, self.tokenizer, self.batches = executor, actor, tokenizer, batches
        # One optimizer step per batch, with an optimizer of its own: carrying its Adam moments
        # (sized for cross-entropy gradients) into RL would shrink the first RL updates.
        self.loss_fn = SupervisedObjective("warmup/loss")
        self.spec = UpdateSpec(max_grad_norm=config.algorithm.max_grad_norm,
                               micro_batch_size=config.roles.actor_train.micro_batch_size,
                               optimizer="warmup", lr=config.warmup.lr, metric_prefix="warmup")

    def step(self) -> dict[str, float]:
        return self.executor.get(start_update(self.actor, self.batches(), self.loss_fn, self.spec))[0]

    def export(self, directory: Path) -> None:
        """The trained model, with its tokenizer, as a Hugging Face directory (replaced atomically;
        under LoRA the adapters merged). The model alone: a checkpoint would also write the
        optimizer's moments, twice the model's size, only to delete them."""
        tmp = directory.with_name(directory.name + "-tmp")
        self.executor.get(self.actor.call("export_model", str(tmp / "model")))
        replace_dir(tmp / "model", directory)
        shutil.rmtree(tmp, ignore_errors=True)
        save_tokenizer(self.tokenizer, directory)

    def run(self, steps: int) -> dict[str, float]:
        """``steps`` steps with a progress bar; the last step's metrics."""
        progress, task = progress_bar(steps, "warm-up (supervised)")
        metrics = {"warmup/loss": float("nan")}
        with progress:
            for _ in range(steps):
                metrics = self.step()
                progress.update(task, advance=1, info=f"loss {metrics['warmup/loss']:.3f}")
        return metrics


class WarmStart:
    """For RL pipelines that may begin with a supervised warm-up of actor_train (``rlvr``, ``agentic``):
    the warm-up itself, and where the policy RL starts from (``warm-model/`` after a warm-up, the
    model before it), which the reference and critic load and LoRA's inference workers merge onto.
    The pipeline sets ``actor``, ``infer``, ``model`` and ``tokenizer`` and says how weights are pushed."""

    config: Any
    executor: Any
    roles: Any
    run_dir: Path
    phase: str
    actor: WorkerGroup
    infer: WorkerGroup
    model: str
    tokenizer: Any

    @property
    def warm_dir(self) -> Path:
        return self.run_dir / "warm-model"

    def start_model(self) -> str:
        """The model RL starts from: ``warm-model/`` once a warm-up wrote it, else the policy's."""
        return str(self.warm_dir) if (self.warm_dir / "config.json").exists() else self.model

    def push_weights(self, policy_update: bool = False) -> None:
        raise NotImplementedError

    def warmup(self, batches: Callable[[], Batch]) -> dict[str, float]:
        """``warmup.steps`` supervised steps on actor_train over ``batches``; the result becomes
        ``warm-model/`` and reaches actor_infer."""
        self.phase = "supervised warm-up"
        self.roles.use("actor_train")
        trainer = SupervisedTrainer(self.executor, self.actor, self.tokenizer, self.config, batches)
        metrics = trainer.run(self.config.warmup.steps)
        self.push_weights()
        trainer.export(self.warm_dir)
        if self.config.roles.actor_train.lora is not None:
            # The warm-up trained adapters: they fold into the base (warm-model/), so the reference,
            # the base with the adapters disabled, is the warmed-up policy, and RL trains fresh ones.
            self.executor.get(self.actor.call("fold_adapters", str(self.warm_dir)) + self.rebase_inference())
            self.push_weights()
        return metrics

    def rebase_inference(self) -> list:
        """Under LoRA after a warm-up, the inference workers merge adapters onto warm-model/ (on
        resume too: the trainer's adapter names its base itself); futures, none otherwise."""
        if self.config.roles.actor_train.lora is None or self.start_model() == self.model:
            return []
        return self.infer.call("rebase_adapters", str(self.warm_dir))


def heldout_loss(executor, actor: WorkerGroup, tokenizer, rows: list[dict]) -> float:
    """Mean cross-entropy per target token of the held-out targets (no gradient)."""
    rows = [{**r, "target": r.get("demonstration") or r["ground_truth"]} for r in rows]
    batch = demonstration_batch(tokenizer, rows, target="target")
    logp, _ = log_probs(executor, actor, batch, temperature=1.0)
    mask = batch["response_mask"].float()
    return float(-(logp * mask).sum() / mask.sum())


class SFTPipeline(ActorLoop):
    headline = ("eval/loss", "held-out loss", "{:.3f}", "supervised steps")
    config_sections = frozenset({"warmup"})

    @classmethod
    def planned_steps(cls, cfg) -> int:
        return cfg.warmup.steps

    def prepare(self) -> None:
        self.model, self.tokenizer = self.policy()
        self.train_rows, self.eval_rows = load_rows(self.config.data, self.plugins, self.tokenizer)

    def build(self) -> None:
        self.actor = self.roles.model_role("actor_train", self.model)
        source = DemonstrationSource(self.tokenizer, self.train_rows, self.config, self.actor.dp_size)
        self.trainer = SupervisedTrainer(self.executor, self.actor, self.tokenizer, self.config, source)
        self.stream = source.stream

    def evaluate(self) -> dict[str, float]:
        return {"eval/loss": heldout_loss(self.executor, self.actor, self.tokenizer, self.eval_rows)} if self.eval_rows else {}

    def step(self, step: int) -> dict[str, float]:
        return self.trainer.step()
