"""The losses trained roles minimise, assembled once from registered pieces into loss functions.

    actor:      loss = agg(policy_loss) - entropy_coef * agg(entropy) + kl_loss_coef * agg(kl(actor, reference))
    critic:     loss = agg(clipped value loss)
    supervised: loss = -sum(log pi(target) * mask) / tokens
    preference: loss = sum over pairs of preference_loss(chosen, rejected) / pairs
    distill:    loss = T^2 * sum(distill_loss(student, teacher) * mask) / tokens

Each is a small frozen object (a *loss function*, :class:`LossFn`) that the driver builds once from
the config, with every registered callable already looked up (:meth:`ActorObjective.from_config`),
and sends with each update to the workers; the core updater (:mod:`roll_core.training`) runs it on
any strategy's engine primitives. So ``hf``, ``fsdp2``, ``deepspeed`` and ``megatron`` optimise
exactly the same thing, no registry is consulted inside a training loop, and a loss plugin that was
registered in the driver's process only still reaches Ray workers (the callable travels by value).

Tokens count where ``loss_mask`` is 1 (the response mask with masked samples removed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from roll_core.algorithms.losses import PolicyLossInput, aggregate, count_sequences, value_loss
from roll_core.data import Batch


def loss_mask_of(batch: Batch) -> torch.Tensor:
    """``loss_mask`` when the pipeline set one, else the response mask. ``[B, R]`` float."""
    return (batch["loss_mask"] if "loss_mask" in batch else batch["response_mask"]).float()


def loss_denominators(batch: Batch) -> tuple[float, float]:
    """``(tokens, sequences)`` that count in the loss of ``batch`` (a whole mini-batch).

    The updater computes these once per mini-batch *before* it is split into micro-batches (and, for
    data parallelism, sums them over ranks) so each micro-batch's loss is a share of the mini-batch
    loss and gradient accumulation does not change the result.
    """
    mask = loss_mask_of(batch)
    return float(mask.sum()), float(count_sequences(mask))


class LossFn(Protocol):
    """What the updater and a strategy's ``forward_backward`` need from a loss.

    ``outputs`` names what the forward pass must return per micro-batch (``log_probs``, ``entropy``,
    ``log_dist`` ``[b, R, V]``, ``values``), computed at ``temperature``. ``additive`` names the
    metrics that are shares of the mini-batch loss (summed over micro-batches and ranks); every
    other metric is a per-micro-batch mean (averaged)."""

    outputs: frozenset[str]
    temperature: float
    additive: frozenset[str]

    def __call__(self, out: dict[str, torch.Tensor], micro: Batch, tokens: float,
                 seqs: float) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss of one micro-batch, scaled by the mini-batch's ``tokens`` and ``seqs``, and metrics."""
        ...


def kl_takes_distribution(name: str, plugins=None) -> bool:
    """Whether KL estimator ``name`` was registered with ``distribution=True`` (takes ``[B, R, V]``)."""
    from roll_core.plugins import get_plugins

    plugins = plugins or get_plugins()
    return bool(plugins.kl_estimators.entry(name).metadata.get("distribution"))


def needs_distribution(config, plugins=None) -> bool:
    """Whether the KL loss term needs full log-distributions ``[B, R, V]`` from the strategy."""
    return bool(config.kl_loss_coef) and kl_takes_distribution(config.kl_estimator, plugins)


def distributions_needed(config, plugins=None) -> tuple[bool, bool]:
    """Whether (the KL loss term, the KL reward penalty) use an estimator that takes full
    log-distributions ``[B, R, V]``: what the reference and old log-prob passes must return."""
    penalty = bool(config.kl_penalty.coef) and kl_takes_distribution(config.kl_penalty.estimator, plugins)
    return needs_distribution(config, plugins), penalty


def reference_read(config, plugins=None) -> bool:
    """Whether anything reads the reference's log-probs: the KL loss term (``kl_loss_coef``), the KL
    reward penalty, on-policy distillation (``opd_coef``), an advantage estimator or policy loss
    registered with ``needs=("reference",)``, or ``kl_metric``. The RL pipelines start
    ``roles.reference`` only when something does: its forward pass over every batch would
    otherwise feed nothing but a metric."""
    from roll_core.plugins import get_plugins

    if config.kl_loss_coef > 0 or config.kl_penalty.coef > 0 or config.opd_coef > 0 or config.kl_metric:
        return True
    plugins = plugins or get_plugins()
    return any("reference" in registry.entry(name).metadata.get("needs", ())
               for registry, name in ((plugins.advantage_estimators, config.advantage_estimator),
                                      (plugins.policy_losses, config.policy_loss)))


def preference_reference_read(dpo, plugins=None) -> bool:
    """Whether the preference loss ``dpo.loss`` reads reference log-probs: every loss but one
    registered with ``reads_reference=False`` (``simpo``), for which ``dpo`` and ``online_dpo``
    start no reference role."""
    from roll_core.plugins import get_plugins

    return (plugins or get_plugins()).preference_losses.entry(dpo.loss).metadata.get("reads_reference", True)


def preference_averages(loss: str, average_log_probs: bool | None, plugins=None) -> bool:
    """Whether preference loss ``loss`` compares per-token mean log-probs: ``dpo.average_log_probs``
    where set, else the loss's registration (``simpo``: ``average_log_probs=True``; sums otherwise)."""
    from roll_core.plugins import get_plugins

    if average_log_probs is not None:
        return average_log_probs
    return (plugins or get_plugins()).preference_losses.entry(loss).metadata.get("average_log_probs", False)


def preference_reference_role(dpo, plugins=None) -> bool:
    """Whether ``dpo`` and ``online_dpo`` start ``roles.reference``: their loss reads reference
    log-probs (:func:`preference_reference_read`) and the data does not carry them
    (``dpo.reference: role``)."""
    return dpo.reference == "role" and preference_reference_read(dpo, plugins)


def reuses_update_log_probs(config, batch_size: int, plugins=None) -> bool:
    """Whether the old log-probs can be the update's own (``algorithm.old_log_probs: auto``).

    With one epoch over one mini-batch the policy takes a single optimizer step per batch, so
    every micro-batch's forward pass runs on the weights the batch's old log-probs would be
    computed with: ``log pi_old = log pi.detach()`` exactly, and the trainer saves a forward pass
    over the whole batch (verl skips it the same way). Not when anything reads them before the
    update: the KL reward penalty, or an estimator registered with ``reads_old_log_probs=True``.
    A pipeline resolves the config's part once (:func:`old_log_probs_reusable`) and checks each
    batch's size with :func:`single_mini_batch`."""
    return old_log_probs_reusable(config, plugins) and single_mini_batch(config, batch_size)


def old_log_probs_reusable(config, plugins=None) -> bool:
    """The part of :func:`reuses_update_log_probs` that depends on the config only."""
    from roll_core.plugins import get_plugins

    if config.old_log_probs != "auto" or config.ppo_epochs != 1 or config.kl_penalty.coef > 0 or config.opd_coef > 0:
        return False
    plugins = plugins or get_plugins()
    return not plugins.advantage_estimators.entry(config.advantage_estimator).metadata.get("reads_old_log_probs")


def single_mini_batch(config, batch_size: int) -> bool:
    """Whether a batch of ``batch_size`` rows is updated as one mini-batch (one optimizer step per epoch)."""
    return config.ppo_mini_batch_size is None or config.ppo_mini_batch_size >= batch_size


def options_model(registry, name: str) -> Any:
    """The pydantic model registered as ``options`` of component ``name`` (imported when it was
    registered by import path), or None for a component registered without one."""
    model = registry.entry(name).metadata.get("options")
    if isinstance(model, str):
        from roll_core.registry import import_target

        model = import_target(model)
    return model


def component_options(registry, name: str, options: dict[str, Any]) -> Any:
    """The validated options object of registered component ``name`` (its registered ``options``
    pydantic model applied to ``options``), or None for a component registered without one."""
    model = options_model(registry, name)
    return None if model is None else model.model_validate(options)


def bind_options(registry, name: str, options: dict[str, Any]) -> Callable:
    """The callable registered as ``name``, called with ``options=`` its validated options object
    when it was registered with an options model (:func:`component_options`)."""
    import functools

    fn = registry.get(name)
    validated = component_options(registry, name, options)
    return fn if validated is None else functools.partial(fn, options=validated)


@dataclass(frozen=True)
class ActorObjective:
    """The policy's loss: registered policy loss and KL estimator, resolved (see the module docstring)."""

    policy_loss: Callable  # fn(PolicyLossInput, config[, options=...]) -> (loss [B, R], metrics)
    config: Any  # the AlgorithmConfig the policy loss reads (clip ranges, caps)
    loss_agg_mode: str
    max_response_length: int | None
    temperature: float
    entropy_coef: float = 0.0
    kl: Callable | None = None  # fn(log_p, log_q) -> kl [B, R]; None without a reference
    kl_loss_coef: float = 0.0
    kl_distribution: bool = False  # the estimator takes [B, R, V] log-distributions
    additive: frozenset[str] = frozenset({"train/pg_loss", "train/kl", "train/entropy"})

    @classmethod
    def from_config(cls, algorithm, rollout=None, plugins=None) -> ActorObjective:
        """Resolve ``algorithm``'s names once (``rollout`` gives the sampling temperature and the
        response horizon of ``seq-mean-token-sum-norm``)."""
        from roll_core.plugins import get_plugins

        plugins = plugins or get_plugins()
        loss = bind_options(plugins.policy_losses, algorithm.policy_loss, algorithm.policy_loss_options)
        return cls(policy_loss=loss, config=algorithm,
                   loss_agg_mode=algorithm.loss_agg_mode,
                   max_response_length=rollout.max_new_tokens if rollout is not None else None,
                   temperature=rollout.temperature if rollout is not None else 1.0,
                   entropy_coef=algorithm.entropy_coef, kl=plugins.kl_estimators.get(algorithm.kl_estimator),
                   kl_loss_coef=algorithm.kl_loss_coef,
                   kl_distribution=kl_takes_distribution(algorithm.kl_estimator, plugins))

    @property
    def outputs(self) -> frozenset[str]:
        wanted = {"log_probs", "entropy"}
        if self.kl_distribution and self.kl_loss_coef:
            wanted.add("log_dist")
        return frozenset(wanted)

    def __call__(self, out, micro, tokens, seqs):
        return actor_loss(out["log_probs"], out.get("entropy"), micro, self, global_tokens=tokens,
                          global_seqs=seqs, log_dist=out.get("log_dist"))


def actor_loss(
    log_prob: torch.Tensor,
    entropy: torch.Tensor | None,
    micro: Batch,
    objective: ActorObjective,
    *,
    global_tokens: float,
    global_seqs: float,
    log_dist: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss of one micro-batch (scaled for accumulation over the mini-batch) and its metrics.

    Shapes: ``log_prob``, ``entropy`` ``[b, R]``; ``log_dist`` ``[b, R, V]`` only when the KL
    estimator takes distributions. ``old_log_probs`` missing from ``micro`` means the update's own,
    detached (:func:`reuses_update_log_probs`).
    """
    mask = loss_mask_of(micro).to(log_prob.dtype)
    horizon = objective.max_response_length or mask.shape[-1]

    def agg(x):
        return aggregate(x, mask, objective.loss_agg_mode, global_tokens=global_tokens,
                         global_seqs=global_seqs, max_response_length=horizon)

    pg_mat, metrics = objective.policy_loss(
        PolicyLossInput(log_prob, micro["old_log_probs"] if "old_log_probs" in micro else log_prob.detach(),
                        micro["advantages"], mask,
                        micro["infer_log_probs"] if "infer_log_probs" in micro else None),
        objective.config,
    )
    pg_loss = agg(pg_mat)
    loss = pg_loss
    metrics = {f"train/{k}": v for k, v in metrics.items()}
    metrics["train/pg_loss"] = pg_loss.item()
    if "infer_log_probs" in micro:  # how far the engine that sampled is from the trainer (same weights on the first pass)
        gap = (log_prob.detach() - micro["infer_log_probs"]).abs() * mask
        metrics["train/infer_log_prob_gap"] = float(gap.sum() / mask.sum().clamp(min=1))
    if entropy is not None:
        ent = agg(entropy)
        metrics["train/entropy"] = ent.item()
        if objective.entropy_coef:
            loss = loss - objective.entropy_coef * ent
    if "ref_log_probs" in micro and objective.kl is not None:
        if objective.kl_distribution:
            # a distribution estimator without distributions: only reported when it is used
            have = log_dist is not None and "ref_log_dist" in micro
            kl_mat = objective.kl(log_dist, micro["ref_log_dist"]) if have else None
        else:
            kl_mat = objective.kl(log_prob, micro["ref_log_probs"])
        if kl_mat is not None:
            kl = agg(kl_mat)
            metrics["train/kl"] = kl.item()
            if objective.kl_loss_coef:
                loss = loss + objective.kl_loss_coef * kl
    return loss, metrics


@dataclass(frozen=True)
class CriticObjective:
    """The value model's loss: clipped regression on ``returns``, aggregated like the policy loss.

    Reads ``values`` (the critic's values at rollout time) and ``returns`` (the estimator's targets)."""

    value_clip: float | None
    loss_agg_mode: str
    max_response_length: int | None = None
    outputs: frozenset[str] = frozenset({"values"})
    temperature: float = 1.0
    additive: frozenset[str] = frozenset({"critic/value_loss"})

    @classmethod
    def from_config(cls, algorithm, rollout=None) -> CriticObjective:
        return cls(algorithm.value_clip, algorithm.loss_agg_mode,
                   rollout.max_new_tokens if rollout is not None else None)

    def __call__(self, out, micro, tokens, seqs):
        return critic_loss(out["values"], micro, self, global_tokens=tokens, global_seqs=seqs)


def critic_loss(values: torch.Tensor, micro: Batch, objective: CriticObjective, *, global_tokens: float,
                global_seqs: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar value loss of one micro-batch (values ``[b, R]``) and metrics."""
    mask = loss_mask_of(micro).to(values.dtype)
    mat = value_loss(values, micro["values"], micro["returns"], objective.value_clip)
    loss = aggregate(mat, mask, objective.loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
                     max_response_length=objective.max_response_length or mask.shape[-1])
    err = ((values.detach() - micro["returns"]) * mask)
    return loss, {"critic/value_loss": loss.item(),
                  "critic/abs_error": float(err.abs().sum() / mask.sum().clamp(min=1))}


@dataclass(frozen=True)
class SupervisedObjective:
    """Cross-entropy of the responses (demonstrations) where the loss mask (:func:`loss_mask_of`:
    ``loss_mask``, else ``response_mask``) is 1, averaged over the mini-batch's target tokens:
    ``loss = -sum(log pi(y_t | x, y_<t) * mask) / tokens``. A multi-turn demonstration sets
    ``loss_mask`` to its actions, so the environment's replies are context, not targets."""

    metric: str = "warmup/loss"
    outputs: frozenset[str] = frozenset({"log_probs"})
    temperature: float = 1.0

    @property
    def additive(self) -> frozenset[str]:
        return frozenset({self.metric})

    def __call__(self, out, micro, tokens, seqs):
        mask = loss_mask_of(micro).to(out["log_probs"].dtype)
        loss = -(out["log_probs"] * mask).sum() / max(tokens, 1.0)
        return loss, {self.metric: loss.item()}


def sequence_log_probs(token_log_probs: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Each response's log-probability ``[B]`` from its tokens' ``[B, R]``: the sum over ``mask``,
    or with ``average`` the per-token mean (IPO's length-normalised form)."""
    total = (token_log_probs * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if average else total


@dataclass(frozen=True)
class PreferenceObjective:
    """A registered preference loss over pairs laid out as consecutive rows: each pair's chosen and
    rejected responses carry the same ``pair`` id and ``chosen`` True / False, and the pipeline keeps
    them in one micro-batch (even micro-batch sizes). ``reference_logp`` ``[B]`` holds the frozen
    reference's sequence log-probs (from a reference role, or precomputed with the data).

        loss = sum_pairs loss_fn(policy and reference log-probs of chosen and rejected) / pairs"""

    loss: Callable[..., Any]
    beta: float
    label_smoothing: float = 0.0
    average_log_probs: bool = False
    options: tuple[tuple[str, Any], ...] = ()  # the loss's own keyword options (frozen and hashable)
    reads_reference: bool = True  # False: a reference-free loss; reference_logp may be zeros
    metric: str = "dpo"
    outputs: frozenset[str] = frozenset({"log_probs"})
    temperature: float = 1.0

    @classmethod
    def from_config(cls, dpo, plugins=None) -> "PreferenceObjective":
        from roll_core.plugins import get_plugins

        plugins = plugins or get_plugins()
        average = preference_averages(dpo.loss, dpo.average_log_probs, plugins)
        return cls(plugins.preference_losses.get(dpo.loss), dpo.beta, dpo.label_smoothing, average,
                   tuple(sorted(dpo.loss_options.items())), preference_reference_read(dpo, plugins))

    def reference_values(self, rows: int) -> torch.Tensor | None:
        """``reference_logp`` for ``rows`` rows of a loss that reads none (zeros); None when the
        loss reads the reference, whose log-probs the pipeline must supply."""
        return None if self.reads_reference else torch.zeros(rows)

    @property
    def additive(self) -> frozenset[str]:
        return frozenset({f"{self.metric}/loss"})

    def __call__(self, out, micro, tokens, seqs):
        from roll_core.algorithms.preference import PreferenceInput

        mask = micro["response_mask"].to(out["log_probs"].dtype)
        policy = sequence_log_probs(out["log_probs"], mask, self.average_log_probs)
        reference = micro["reference_logp"].to(policy)
        chosen = pair_sides(micro)
        inputs = PreferenceInput(policy[chosen], policy[~chosen], reference[chosen], reference[~chosen])
        per_pair, metrics = self.loss(inputs, beta=self.beta, label_smoothing=self.label_smoothing,
                                      **dict(self.options))
        loss = per_pair.sum() / max(seqs / 2, 1.0)
        return loss, {f"{self.metric}/loss": loss.item(), **{f"{self.metric}/{k}": v for k, v in metrics.items()}}


def pair_tags(pairs: int) -> dict[str, torch.Tensor]:
    """The tags of ``pairs`` pairs laid out as consecutive rows, chosen then rejected: ``pair`` ids
    ``[2P]`` and the ``chosen`` mask ``[2P]`` that :func:`pair_sides` reads back."""
    return {"pair": torch.arange(pairs).repeat_interleave(2), "chosen": torch.tensor([True, False]).repeat(pairs)}


def pair_sides(micro: Batch) -> torch.Tensor:
    """The ``chosen`` mask ``[B]`` of rows laid out as preference pairs (``pair`` ids, ``chosen``
    True / False), checked to hold each of its pairs whole, in the same order on both sides."""
    chosen = micro["chosen"].bool()
    if not torch.equal(micro["pair"][chosen], micro["pair"][~chosen]):
        raise ValueError("a micro-batch holds half of a preference pair: micro-batch and per-rank batch sizes "
                         "must be even numbers of rows (whole pairs)")
    return chosen


def last_response_values(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each row's value at its last response token ``[B]``, from values ``[B, R]`` (a value model's
    output at the position before each response token). With the EOS that ends every target, that
    is the output after the prompt and the whole response text: where a sequence classifier reads
    its score of the same text without the EOS (roll-rewards' ``reward_model``)."""
    last = (response_mask.sum(-1) - 1).clamp(min=0).to(values.device)
    return values.gather(-1, last[:, None]).squeeze(-1)


@dataclass(frozen=True)
class RewardModelObjective:
    """A reward model's Bradley-Terry loss (:func:`~roll_core.algorithms.preference.bradley_terry`)
    over pairs laid out as :class:`PreferenceObjective`'s; each response's score is the value
    model's output at its last response token (:func:`last_response_values`)::

        loss = sum_pairs -log sigmoid(r_chosen - r_rejected) / pairs"""

    metric: str = "reward_model"
    outputs: frozenset[str] = frozenset({"values"})
    temperature: float = 1.0

    @property
    def additive(self) -> frozenset[str]:
        return frozenset({f"{self.metric}/loss"})

    def __call__(self, out, micro, tokens, seqs):
        from roll_core.algorithms.preference import bradley_terry

        scores = last_response_values(out["values"], micro["response_mask"])
        chosen = pair_sides(micro)
        per_pair, metrics = bradley_terry(scores[chosen], scores[~chosen])
        loss = per_pair.sum() / max(seqs / 2, 1.0)
        return loss, {f"{self.metric}/loss": loss.item(), **{f"{self.metric}/{k}": v for k, v in metrics.items()}}


@dataclass(frozen=True)
class DistillObjective:
    """A registered distillation loss between the student's next-token distributions (its forward
    pass's ``log_dist`` at ``temperature``) and the teacher's, which the pipeline puts in the batch:
    ``teacher_logp`` ``[B, R, K]`` (the teacher's log-probs at ``temperature``) and, when ``K`` is the
    teacher's top-k rather than the vocabulary, ``teacher_index`` ``[B, R, K]`` (their token ids).
    With top-k, both sides are the ``K`` tokens plus a tail bucket for the rest of their mass
    (:func:`roll_core.algorithms.distill.kd_log_probs`).

        loss = T^2 * sum(distill_loss(student, teacher) * mask) / tokens

    ``T^2`` keeps gradient magnitudes comparable across temperatures (Hinton et al. 2015)."""

    loss: Callable[..., torch.Tensor]
    temperature: float = 1.0
    options: tuple[tuple[str, Any], ...] = ()  # keyword options of ``loss`` (a tuple: frozen and hashable)
    metric: str = "distill"
    outputs: frozenset[str] = frozenset({"log_dist"})

    @classmethod
    def from_config(cls, distill, plugins=None) -> "DistillObjective":
        from roll_core.plugins import get_plugins

        loss = (plugins or get_plugins()).distill_losses.get(distill.loss)
        return cls(loss, distill.temperature, tuple(sorted(distill.loss_options.items())))

    @property
    def additive(self) -> frozenset[str]:
        return frozenset({f"{self.metric}/loss"})

    def per_token(self, student_log_dist: torch.Tensor, micro: Batch) -> torch.Tensor:
        """The divergence ``[B, R]`` at every response position (no mask, no scale)."""
        from roll_core.algorithms.distill import with_tail

        teacher = micro["teacher_logp"].to(student_log_dist)
        if "teacher_index" in micro:  # the teacher's top-k and a tail bucket (kd_log_probs)
            student_log_dist = with_tail(student_log_dist.gather(-1, micro["teacher_index"].to(student_log_dist.device)))
            teacher = with_tail(teacher)
        return self.loss(student_log_dist, teacher, **dict(self.options))

    def __call__(self, out, micro, tokens, seqs):
        mask = loss_mask_of(micro).to(out["log_dist"].dtype)
        loss = self.temperature ** 2 * (self.per_token(out["log_dist"], micro) * mask).sum() / max(tokens, 1.0)
        return loss, {f"{self.metric}/loss": loss.item()}
