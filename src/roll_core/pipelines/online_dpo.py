"""``online_dpo``: DPO on pairs that the policy samples itself, labelled by the run's reward.

Offline DPO (the ``dpo`` pipeline) learns from a fixed set of pairs written by other models; as the
policy moves away from them they say less and less about its own mistakes. Online DPO (Guo et al.
2024, "Direct Language Model Alignment from Online AI Feedback", arXiv:2402.04792) samples the pairs
from the current policy at every step and has a judge label them. Here the judge is the run's
reward, as in ``rlvr``: a verifier, an LLM judge, or a learned reward model (roll-rewards'
``reward_model``, trained by the ``reward_model`` pipeline). One step::

    scheduler.next_batch()   rollout.num_return_sequences samples per prompt on actor_infer, scored
                             by the reward workers (dynamic sampling, if set, drops tied groups)
    -> each group's best- and worst-scored samples as a (chosen, rejected) pair, among those rlvr's
       sample masks keep (algorithm.max_length_mask, difficulty_mask); a group whose samples all
       score alike gives none (algorithms.preference.best_worst_pairs)
    -> the reference's sequence log-probs of both sides (roles.reference, frozen at RL's start;
       none for a reference-free loss: simpo)
    -> one update of actor_train with the registered preference loss (dpo.loss, dpo.beta, ...)
    -> weight push to actor_infer

Everything else is ``rlvr``'s: the supervised warm-up, the held-out accuracy before and after
(``roles.eval_reward`` included), placement, checkpoints and resume. Run::

    roll run pipeline=online_dpo
"""

from __future__ import annotations

import time

import torch

from roll_core.algorithms.objective import PreferenceObjective, pair_tags, sequence_log_probs
from roll_core.algorithms.preference import best_worst_pairs
from roll_core.data import Batch
from roll_core.pipelines.dpo import PreferenceTraining
from roll_core.pipelines.rlvr import RLVRPipeline
from roll_core.pipelines.runtime import log_probs, start_update
from roll_core.training import UpdateSpec


def pair_rows(batch: Batch, pairs: torch.Tensor) -> Batch:
    """The rows of ``pairs`` ``[P, 2]`` (chosen, rejected), each pair as two consecutive rows tagged
    with ``pair`` and ``chosen``, the layout :class:`PreferenceObjective` reads."""
    return batch.select(pairs.flatten().tolist()).update(**pair_tags(len(pairs)))


#: The ``algorithm`` keys online_dpo reads: the sample masks (which samples may be paired), dynamic
#: sampling (in the scheduler) and gradient clipping. The rest are rlvr's advantages, loss and
#: reward shaping; set to anything but their defaults, they are refused rather than ignored.
ALGORITHM_KEYS_READ = {"max_length_mask", "difficulty_mask", "dynamic_sampling", "max_grad_norm"}


class OnlineDPOPipeline(PreferenceTraining, RLVRPipeline):
    step_label = "online DPO step"
    config_sections = frozenset({"warmup", "dpo"})
    no_reference_fix = "a reference-free loss: simpo"
    policy_update = None  # the update is the preference loss on the step's pairs, not rlvr's on its batch

    @classmethod
    def config_problems(cls, cfg, plugins) -> list[str]:
        """Pairs come from the run itself (:meth:`group_problems`), so no precomputed reference
        log-probs; no critic; the update is the preference loss, so rlvr's loss and shaping settings
        (``algorithm`` keys beyond :data:`ALGORITHM_KEYS_READ`) are refused rather than ignored."""
        problems = super().config_problems(cfg, plugins)
        if cfg.dpo.reference != "role":
            problems.append("key 'dpo.reference': online_dpo samples its pairs as it runs, so no log-probs can be "
                            "precomputed; use 'role'")
        if cfg.roles.critic is not None:
            problems.append("key 'roles.critic': pipeline online_dpo trains no critic: set roles.critic=null")
        defaults = type(cfg.algorithm)().model_dump()
        unread = [key for key, value in cfg.algorithm.model_dump().items()
                  if key not in ALGORITHM_KEYS_READ and value != defaults[key]]
        if unread:
            problems.append(f"key 'algorithm.{unread[0]}': online_dpo's update is the preference loss (dpo.loss, "
                            f"with dpo.beta its pull toward the reference), one step per batch; rlvr's "
                            f"{', '.join('algorithm.' + k for k in unread)} does not apply")
        return problems

    @classmethod
    def group_problems(cls, cfg, plugins) -> list[str]:
        """A pair is two different samples of one prompt (no advantage estimator is read)."""
        if cfg.rollout.num_return_sequences < 2:
            return ["key 'rollout.num_return_sequences': online_dpo pairs samples of one prompt, so it must be at "
                    f"least 2, got {cfg.rollout.num_return_sequences}"]
        if cfg.rollout.temperature == 0:
            return ["key 'rollout.temperature': 0 samples greedily, so every answer to a prompt is the same and "
                    "online_dpo finds no pair; sample with a temperature above 0"]
        return []

    def build(self) -> None:
        super().build()
        cfg = self.config
        self.preference_loss = PreferenceObjective.from_config(cfg.dpo, self.plugins)
        self.preference_spec = UpdateSpec(max_grad_norm=cfg.algorithm.max_grad_norm,
                                          micro_batch_size=cfg.roles.actor_train.micro_batch_size, metric_prefix="dpo")

    def _spawn_policy_copies(self, model_path: str) -> None:
        """The reference, from the policy RL begins with, where the loss reads one; no critic."""
        if self.starts_reference(self.config, self.plugins):
            self.reference = self.roles.reference(self.actor, model_path)

    def streamed_reference(self):
        return None  # the step reads the reference's log-probs of the pairs' rows only

    def step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        batch, metrics = self.collect()
        t_rollout = time.perf_counter() - t0
        keep = self.shaper.sample_mask(batch)  # algorithm.max_length_mask, difficulty_mask
        pairs = best_worst_pairs(batch["scores"], batch["group_index"], keep.bool())
        groups = len(torch.unique(batch["group_index"]))
        usable = len(pairs) - len(pairs) % self.actor.dp_size  # each data-parallel rank takes whole pairs
        metrics.update({"online_dpo/pairs": float(usable), "online_dpo/unpaired_groups": 1 - len(pairs) / groups,
                        "shaping/masked_samples": float(len(batch) - keep.sum()), **self.reward.pop_failures()})
        t1 = time.perf_counter()
        if usable:
            metrics.update(self._update(step, pair_rows(batch, pairs[:usable])))
        t_train = time.perf_counter() - t1
        t2 = time.perf_counter()
        if usable:
            self.push_weights(policy_update=True)
        metrics.update({"data/epoch": self.stream.epoch, "time/rollout_s": t_rollout, "time/train_s": t_train,
                        "time/weight_sync_s": time.perf_counter() - t2, "time/step_s": time.perf_counter() - t0,
                        **self.roles.residency.metrics()})
        return metrics

    def _update(self, step: int, pairs: Batch) -> dict[str, float]:
        """One preference update on ``pairs`` against the reference; its metrics."""
        objective = self.preference_loss
        reference_logp = objective.reference_values(len(pairs))
        if reference_logp is None:
            assert self.reference is not None  # spawned before the first step (begin, restore)
            self.roles.use(self.reference.resident_role)
            reference, _ = log_probs(self.executor, self.reference, pairs, objective.temperature)
            reference_logp = sequence_log_probs(reference, pairs["response_mask"].float(), objective.average_log_probs)
        pairs.update(reference_logp=reference_logp)
        self.dump_rollouts(step, pairs)
        self.roles.use("actor_train")
        pending = start_update(self.actor, pairs, objective, self.preference_spec)
        metrics = self.scheduler.wait(pending[0])  # a scheduler may generate meanwhile
        self.executor.get(pending[1:])
        return metrics
