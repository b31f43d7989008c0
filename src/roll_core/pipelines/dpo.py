"""``dpo``: direct preference optimisation on pairs of responses to one prompt.

Rows with a ``rejected`` response are pairs; the ``chosen`` one is the row's ``chosen``, or its
``ground_truth`` (the embedded ``carry_addition`` task pairs the right sum with the careless
teacher's). Each step takes ``dpo.batch_size`` pairs in a seeded, resumable order and makes one
optimizer step on actor_train with the registered preference loss ``dpo.loss`` (``dpo_sigmoid``,
``ipo``, ``simpo``, or a plugin's), against a frozen reference: ``roles.reference`` (by default the
same model), or log-probs precomputed with the data (``dpo.reference: precomputed``, fields
``reference_chosen_logp`` / ``reference_rejected_logp``); a reference-free loss (``simpo``) needs
neither. The held-out metric is the preference
accuracy: the share of held-out pairs whose chosen response gets the higher implicit reward
``beta * log(pi / pi_ref)``.

    roll run pipeline=dpo trainer.max_steps=60 trainer.eval_every=20
"""

from __future__ import annotations

import torch

from roll_core.algorithms.objective import (PreferenceObjective, pair_tags, preference_averages,
                                           preference_reference_role, sequence_log_probs)
from roll_core.data import Batch, PromptStream
from roll_core.errors import ConfigError, RegistryError
from roll_core.pipelines import Pipeline
from roll_core.pipelines.batches import demonstration_batch
from roll_core.pipelines.runtime import SEED_OFFSETS, ActorLoop, log_probs, start_update
from roll_core.pipelines.sources import load_rows
from roll_core.training import UpdateSpec

PRECOMPUTED = ("reference_chosen_logp", "reference_rejected_logp")


def preference_pairs(rows: list[dict]) -> list[dict]:
    """The rows that are pairs (they have a ``rejected`` response), with ``chosen`` filled in from
    ``ground_truth`` where the row has none."""
    return [{**r, "chosen": r.get("chosen", r.get("ground_truth"))} for r in rows if r.get("rejected") is not None]


def load_pairs(pipeline: str, data, plugins, tokenizer) -> tuple[list[dict], list[dict]]:
    """The training and held-out preference pairs of the ``data`` section (:func:`preference_pairs`);
    a config error naming ``pipeline`` when no training row is a pair."""
    train_rows, eval_rows = load_rows(data, plugins, tokenizer)
    train, held_out = preference_pairs(train_rows), preference_pairs(eval_rows)
    if not train:
        raise ConfigError(f"pipeline {pipeline}: no training row is a preference pair (a row with 'rejected', and "
                          f"'chosen' or 'ground_truth')")
    return train, held_out


def pair_batch(tokenizer, pairs: list[dict]) -> Batch:
    """Each pair as two consecutive rows, chosen then rejected, tagged with ``pair`` and ``chosen``
    so the loss can check that no split separated them."""
    rows = [{"prompt": p["prompt"], "images": p.get("images"), "target": p[side]}
            for p in pairs for side in ("chosen", "rejected")]
    batch = demonstration_batch(tokenizer, rows, target="target")
    return batch.update(**pair_tags(len(pairs)))


def odd_micro_batch(cfg, trained: str) -> list[str]:
    """A pipeline training role ``trained`` on pairs keeps each pair in one micro-batch (the loss
    compares its two sides), so the role's micro-batch must be even."""
    micro = cfg.role(trained).micro_batch_size
    return [f"key 'roles.{trained}.micro_batch_size': {cfg.pipeline} keeps each pair in one micro-batch, so it "
            f"must be even, got {micro}"] if micro % 2 else []


def missing_reference(cfg, plugins, no_reference_fix: str) -> list[str]:
    """``roles.reference`` is needed where the preference loss reads reference log-probs that the
    data does not carry; ``no_reference_fix`` says how else the pipeline runs without one."""
    if cfg.roles.reference is not None:
        return []
    try:
        needed = preference_reference_role(cfg.dpo, plugins)
    except RegistryError:
        return []  # an unknown dpo.loss: reported as an unknown name
    return [f"key 'dpo.reference': 'role' needs roles.reference, which is null, for preference loss "
            f"'{cfg.dpo.loss}' (add roles.reference={{}}, or {no_reference_fix})"] if needed else []


class PreferenceTraining(Pipeline):
    """What the pipelines that train ``actor_train`` with the preference loss ``dpo.loss`` share
    (``dpo``, ``online_dpo``): a reference starts only where the loss reads one that the data lacks;
    pairs need even micro-batches and, where the loss reads a reference, ``roles.reference`` or
    another source (``no_reference_fix``); ``dpo.average_log_probs: null`` resumes as the choice it
    resolves to (a run saved with ``false`` under ``dpo_sigmoid`` resumes under the null)."""

    no_reference_fix = "set dpo.reference=precomputed"  # how else the pipeline runs without roles.reference

    @classmethod
    def starts_reference(cls, cfg, plugins) -> bool:
        return cfg.roles.reference is not None and preference_reference_role(cfg.dpo, plugins)

    @classmethod
    def config_problems(cls, cfg, plugins) -> list[str]:
        return (super().config_problems(cfg, plugins) + odd_micro_batch(cfg, "actor_train")
                + missing_reference(cfg, plugins, cls.no_reference_fix))

    @classmethod
    def resume_view(cls, flat: dict, plugins) -> dict:
        view = super().resume_view(flat, plugins)
        if "dpo.loss" in view and view.get("dpo.average_log_probs", False) is None:
            try:
                view["dpo.average_log_probs"] = preference_averages(view["dpo.loss"], None, plugins)
            except RegistryError:
                pass  # a loss no longer registered: compared as saved (a change of dpo.loss shows anyway)
        return view


class DPOPipeline(PreferenceTraining, ActorLoop):
    headline = ("eval/rewards/accuracy", "held-out preference accuracy", "{:.1%}", "DPO steps")
    config_sections = frozenset({"dpo"})

    def prepare(self) -> None:
        cfg = self.config
        self.model, self.tokenizer = self.policy()
        self.train_pairs, self.eval_pairs = load_pairs("dpo", cfg.data, self.plugins, self.tokenizer)
        self.loss_fn = PreferenceObjective.from_config(cfg.dpo, self.plugins)
        # a reference role where the loss reads one: the loader checked that it is configured
        if cfg.dpo.reference == "precomputed" and self.loss_fn.reads_reference:
            missing = [k for k in PRECOMPUTED if any(k not in p for p in self.train_pairs + self.eval_pairs)]
            if missing:
                raise ConfigError(f"key 'dpo.reference': precomputed needs {missing} in every pair")
        self.spec = UpdateSpec(max_grad_norm=cfg.algorithm.max_grad_norm,
                               micro_batch_size=cfg.roles.actor_train.micro_batch_size, metric_prefix="dpo")

    def build(self) -> None:
        self.eval_reference = None
        self.actor = self.roles.model_role("actor_train", self.model)
        self.reference = None
        if self.starts_reference(self.config, self.plugins):
            self.reference = self.roles.reference(self.actor, self.model)
        self.stream = PromptStream(self.train_pairs, self.config.seed + SEED_OFFSETS["preference_data"])

    def _with_reference(self, batch: Batch, pairs: list[dict]) -> Batch:
        """``reference_logp`` ``[2P]``: the reference's sequence log-probs of every row (zeros for
        a loss that reads none)."""
        unread = self.loss_fn.reference_values(len(batch))
        if unread is not None:
            return batch.update(reference_logp=unread)
        if self.reference is None:
            values = [p[k] for p in pairs for k in PRECOMPUTED]
            return batch.update(reference_logp=torch.tensor(values, dtype=torch.float32))
        tokens, _ = log_probs(self.executor, self.reference, batch, temperature=1.0)
        return batch.update(reference_logp=sequence_log_probs(tokens, batch["response_mask"].float(),
                                                              self.loss_fn.average_log_probs))

    def step(self, step: int) -> dict[str, float]:
        pairs = self.stream.next(self.config.dpo.batch_size)
        batch = self._with_reference(pair_batch(self.tokenizer, pairs), pairs)
        return self.executor.get(start_update(self.actor, batch, self.loss_fn, self.spec))[0]

    def evaluate(self) -> dict[str, float]:
        """The preference loss and implicit-reward metrics of the held-out pairs (no gradient)."""
        if not self.eval_pairs:
            return {}
        batch = pair_batch(self.tokenizer, self.eval_pairs)
        if self.eval_reference is None:  # the reference is frozen: once per attempt
            self.eval_reference = self._with_reference(batch, self.eval_pairs)["reference_logp"]
        batch.update(reference_logp=self.eval_reference)
        tokens, _ = log_probs(self.executor, self.actor, batch, temperature=1.0)
        _, metrics = self.loss_fn({"log_probs": tokens}, batch, 0.0, float(len(batch)))
        return {k.replace("dpo/", "eval/"): v for k, v in metrics.items()}
