"""``distill``: knowledge distillation from a teacher model into the student (actor_train).

The teacher is an inference role, ``roles.reference`` unless ``distill.teacher`` names another
(``roles.teacher: {kind: infer, model_path: ...}``), with its own ``model_path`` (any model with
the student's tokenizer). Each step takes ``distill.batch_size`` prompts in a seeded, resumable order, with their
responses: given with the data (each row's ``demonstration``, else its ``ground_truth``) or written
by the teacher (``distill.responses: teacher``). The teacher then scores that batch only, so its
distributions are streamed step by step and never stored for the data set; with ``distill.top_k``
each position sends its ``k`` most likely tokens instead of the vocabulary. The student makes one
optimizer step on the registered distillation loss ``distill.loss`` at ``distill.temperature``
(:class:`~roll_core.algorithms.objective.DistillObjective`). The held-out metric is the forward
KL(teacher || student) per response token at temperature 1, over the whole vocabulary.

    roll run pipeline=distill roles.reference.model_path=<teacher dir> distill.loss=jsd trainer.max_steps=100
"""

from __future__ import annotations

import torch

from roll_core.algorithms.distill import forward_kl
from roll_core.algorithms.objective import DistillObjective
from roll_core.data import Batch, PromptStream
from roll_core.errors import ConfigError
from roll_core.multimodal import encode_prompts
from roll_core.pipelines.batches import demonstration_batch
from roll_core.pipelines.runtime import SEED_OFFSETS, ActorLoop, load_tokenizer, log_probs, start_update
from roll_core.pipelines.sources import load_rows
from roll_core.training import UpdateSpec


def _given(rows: list[dict]) -> list[dict]:
    return [{**r, "target": r.get("demonstration") or r["ground_truth"]} for r in rows]


def _padded_cat(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """Per-replica ``[b, r, K]`` parts joined along the batch, responses right-padded to ``width``."""
    return torch.cat([torch.nn.functional.pad(p, (0, 0, 0, width - p.shape[1])) for p in parts])


class DistillPipeline(ActorLoop):
    headline = ("eval/kl_to_teacher", "held-out KL(teacher || student)", "{:.4f}", "distillation steps")
    config_sections = frozenset({"distill"})

    @classmethod
    def config_problems(cls, cfg, plugins) -> list[str]:
        return super().config_problems(cfg, plugins) + cfg.named_role_problems(
            "distill.teacher", cfg.distill.teacher, "infer")

    @classmethod
    def generating_roles(cls, cfg) -> list[str]:
        """The teacher too where it writes the responses (``distill.responses: teacher``)."""
        return super().generating_roles(cfg) + ([cfg.distill.teacher] if cfg.distill.responses == "teacher" else [])

    def prepare(self) -> None:
        cfg = self.config
        self.model, self.tokenizer = self.policy()
        teacher = cfg.role(cfg.distill.teacher, "infer")  # checked with the config: present, of kind infer
        self.teacher_path = teacher.model_path or self.model
        if load_tokenizer(self.teacher_path).get_vocab() != self.tokenizer.get_vocab():
            raise ConfigError(f"key 'roles.{cfg.distill.teacher}.model_path': the teacher's tokenizer "
                              f"({self.teacher_path}) differs from the student's; distillation compares "
                              f"distributions token by token")
        self.train_rows, self.eval_rows = load_rows(cfg.data, self.plugins, self.tokenizer)
        self.loss_fn = DistillObjective.from_config(cfg.distill, self.plugins)
        self.spec = UpdateSpec(max_grad_norm=cfg.algorithm.max_grad_norm,
                               micro_batch_size=cfg.roles.actor_train.micro_batch_size, metric_prefix="distill")

    def build(self) -> None:
        self.actor, self.teacher = self.roles.model_roles(("actor_train", self.model),
                                                          (self.config.distill.teacher, self.teacher_path))
        self.stream = PromptStream(self.train_rows, self.config.seed + SEED_OFFSETS["distill_data"])

    def _responses(self, rows: list[dict]) -> Batch:
        if self.config.distill.responses == "given":
            return demonstration_batch(self.tokenizer, _given(rows), target="target")
        parts = self.executor.get(self.teacher.per_replica(
            "generate", Batch(encode_prompts(self.tokenizer, rows)), **self.config.rollout.sampling()))
        return Batch.concat(parts)

    def _with_teacher(self, batch: Batch) -> Batch:
        """The teacher's log-probs at the distillation temperature: top-k ``teacher_logp`` and
        ``teacher_index``, or the whole vocabulary."""
        cfg, width = self.config.distill, batch["responses"].shape[1]
        if cfg.top_k is None:
            _, dist = log_probs(self.executor, self.teacher, batch, cfg.temperature, distribution=True)
            return batch.update(teacher_logp=dist)
        parts = self.executor.get(self.teacher.per_replica("top_k_log_probs", batch, temperature=cfg.temperature,
                                                           k=cfg.top_k))
        return batch.update(teacher_logp=_padded_cat([v for v, _ in parts], width),
                            teacher_index=_padded_cat([i for _, i in parts], width))

    def step(self, step: int) -> dict[str, float]:
        batch = self._with_teacher(self._responses(self.stream.next(self.config.distill.batch_size)))
        return self.executor.get(start_update(self.actor, batch, self.loss_fn, self.spec))[0]

    def evaluate(self) -> dict[str, float]:
        """KL(teacher || student) per token of the held-out rows' given responses (temperature 1)."""
        if not self.eval_rows:
            return {}
        batch = demonstration_batch(self.tokenizer, _given(self.eval_rows), target="target")
        _, student = log_probs(self.executor, self.actor, batch, 1.0, distribution=True)
        _, teacher = log_probs(self.executor, self.teacher, batch, 1.0, distribution=True)
        assert student is not None and teacher is not None  # asked for with distribution=True
        mask = batch["response_mask"].float()
        return {"eval/kl_to_teacher": float((forward_kl(student, teacher) * mask).sum() / mask.sum())}
