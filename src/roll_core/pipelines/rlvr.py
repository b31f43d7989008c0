"""``rlvr``: reinforcement learning with verifiable rewards, driven by a single controller.

One step::

    scheduler.next_batch()   prompts -> groups generated on actor_infer, scored on the reward workers
                             [-> dynamic sampling: groups that fail the filter are replaced]
    -> reference and old log-probs [, critic values]
    -> reward shaping and advantages (roll_core.algorithms.shaping, in its documented order)
    -> policy update on actor_train [, value update on critic]   (scheduler.wait: it may generate on)
    -> weight push to actor_infer (roll_core.runtime.weight_sync) -> metrics

Before RL, the ``sft`` pipeline's trainer imitates the data's demonstrations (``warmup.steps``), and
held-out accuracy (greedy decoding) is measured before and after RL. Everything else (placement,
colocation, checkpoints, resume, restarts, trackers) is the runtime's: :mod:`roll_core.pipelines.runtime`.

Run it: ``roll run`` (the embedded default) or ``roll run my.yaml key=value ...``.
"""

from __future__ import annotations

import time
from pathlib import Path

from roll_core.algorithms.objective import (CriticObjective, distributions_needed, old_log_probs_reusable,
                                           single_mini_batch)
from roll_core.algorithms.shaping import RewardShaper
from roll_core.config.loader import group_baseline_problems
from roll_core.data import Batch, DomainMixer, PromptStream
from roll_core.multimodal import encode_prompts
from roll_core.pipelines import mismatch
from roll_core.pipelines.runtime import (PolicyGradientLoop, log_probs, save_tokenizer_beside, start_update, values,
                                        warn_if_oversubscribed)
from roll_core.pipelines.sft import DemonstrationSource, WarmStart
from roll_core.pipelines.sources import check_domains, check_ground_truth, load_rows
from roll_core.rollout import overlaps_training
from roll_core.rollout.metrics import accuracy_summary, batch_metrics, heldout_accuracy, idle_times
from roll_core.runtime import weight_sync
from roll_core.runtime.executor import WorkerGroup
from roll_core.training import UpdateSpec, policy_gradient_update


class RLVRPipeline(WarmStart, PolicyGradientLoop):
    step_label = "RL step"
    reads_eval_reward = True
    config_sections = frozenset({"warmup"})
    @classmethod
    def config_problems(cls, cfg, plugins) -> list[str]:
        return super().config_problems(cfg, plugins) + cls.group_problems(cfg, plugins)

    @classmethod
    def describe_task(cls, cfg) -> str:
        rewards = [cfg.roles.reward.name] + [f"{domain}: {'+'.join(r.name for r in spec.rewards)}"
                                             for domain, spec in cfg.roles.domain_rewards.items()]
        judge = cfg.roles.eval_reward
        return (f"{super().describe_task(cfg)}, reward {'; '.join(rewards)}"
                + (f", evaluated by {judge.name}" if judge is not None else ""))

    @classmethod
    def group_problems(cls, cfg, plugins) -> list[str]:
        """What each prompt's group of samples needs for the update to learn from it."""
        return group_baseline_problems(cfg, plugins, "rollout.num_return_sequences", cfg.rollout.num_return_sequences,
                                       greedy=cfg.rollout.temperature == 0)

    # -- set-up ---------------------------------------------------------------------------------
    def prepare(self) -> None:
        cfg = self.config
        self.model, self.tokenizer = self.policy()
        self.train_rows, self.eval_rows = load_rows(cfg.data, self.plugins, self.tokenizer)
        check_ground_truth(self.train_rows, "training")
        check_ground_truth(self.eval_rows, "held-out")
        check_domains(self.train_rows, cfg.roles.domain_rewards)
        self.multi_domain = len({r.get("domain", "default") for r in self.train_rows}) > 1 or bool(cfg.roles.domain_rewards)
        self.overlapping = overlaps_training(cfg.rollout.scheduler, self.plugins)

    def build(self) -> None:
        cfg, roles = self.config, self.config.roles
        mixed = cfg.data.domain_interleave_probs
        self.stream = DomainMixer(self.train_rows, mixed, cfg.seed) if mixed else PromptStream(self.train_rows, cfg.seed)
        self.shaper = RewardShaper(cfg.algorithm, self.plugins)
        self.reward = self.roles.rewards()  # first: a reward that rejects its options stops before any model loads
        self.eval_reward = self.roles.eval_rewards()  # roles.eval_reward, or None: self.reward scores evaluations
        self.actor, self.infer = self.roles.model_roles(("actor_train", self.model), ("actor_infer", self.model))
        self.weights = weight_sync.connect(cfg, self.executor, self.actor, self.infer, self.overlapping, self.plugins)
        # an inference worker that takes one call at a time runs a queued weight update before the
        # generate calls sent after it; one that serves requests concurrently gives no such order
        engine = self.plugins.infer_strategies.get(roles.actor_infer.strategy)
        self.ordered_infer = not getattr(engine, "concurrent_requests", False)
        self.scheduler = self.plugins.schedulers.get(cfg.rollout.scheduler)(
            cfg, self.executor, self.infer, self.reward, self.tokenizer)
        self.reference: WorkerGroup | None = None  # spawned from the policy RL starts with (begin, restore)
        self.critic: WorkerGroup | None = None
        # whether the reference / old log-prob passes must return full distributions (loss term, penalty)
        self.dist_loss, self.dist_penalty = distributions_needed(cfg.algorithm, self.plugins)
        self.reusable_old = old_log_probs_reusable(cfg.algorithm, self.plugins)
        self.actor_update = policy_gradient_update(cfg, self.plugins)
        if roles.critic is not None:
            self.critic_update = (CriticObjective.from_config(cfg.algorithm, cfg.rollout),
                                  UpdateSpec.from_config(cfg.algorithm, roles.critic, prefix="critic"))

    def _spawn_policy_copies(self, model_path: str) -> None:
        """Roles that start from the policy RL begins with (the warmed-up model): reference, critic.
        A reference with its own ``model_path`` is a different model (a distillation teacher)."""
        self.reference, self.critic = self.roles.policy_copies(
            self.actor, model_path, self.starts_reference(self.config, self.plugins), self.config.roles.critic)

    def begin(self) -> dict[str, float]:
        first = {}
        if self.config.warmup.steps:
            first = self.warmup(DemonstrationSource(self.tokenizer, self.train_rows, self.config, self.actor.dp_size))
        self._spawn_policy_copies(self.start_model())
        first.update(self._initial_mismatch())
        self.before_rl = self.evaluate()
        if self.before_rl:
            print(f"held-out accuracy before RL (greedy): {self.before_rl['eval/accuracy']:.1%}", flush=True)
        return {**first, **self.before_rl}

    def _initial_mismatch(self) -> dict[str, float]:
        """Step 0's train/inference log-prob gap on held-out prompts, gated by
        ``trainer.max_initial_mismatch`` (:mod:`roll_core.pipelines.mismatch`)."""
        if not self.eval_rows:
            return {}
        prompts = encode_prompts(self.tokenizer, self.eval_rows[:mismatch.PROMPTS])
        gap = mismatch.initial_mismatch(self.executor, self.infer, self.actor, Batch(prompts), self.config.rollout,
                                        use=self.roles.use)
        mismatch.check_mismatch(gap, self.config.trainer.max_initial_mismatch)
        return {"train/infer_log_prob_gap": gap}

    def streamed_reference(self):
        """The reference whose log-probs the scheduler computes as samples arrive (None: the step
        does): one on its own devices, where token log-probs are enough and generation overlaps."""
        streamed = (self.reference is not None and self.reference.serves is None and self.overlapping
                    and not self.roles.residency.colocation.get("reference")
                    and not (self.dist_loss or self.dist_penalty))
        return self.reference if streamed else None

    def before_steps(self) -> None:
        self.roles.record(self.run_dir / "placement.json")
        self.scheduler.start(self.stream, reference=self.streamed_reference())
        if self.overlapping:
            warn_if_oversubscribed(self.config)
        self.roles.set_threads(rl=True)

    def after_steps(self) -> None:
        self.scheduler.stop()  # no request outlives the run
        self.weights.finish()
        self.roles.set_threads(rl=False)

    # -- one step ---------------------------------------------------------------------------------
    def collect(self):
        """One step's scored groups (after dynamic sampling) and the rollout metrics."""
        self.roles.use("actor_infer")
        if not self.ordered_infer:
            self.settle_weights()
        batch, metrics = self.scheduler.next_batch()
        self.settle_weights()  # done before these samples were drawn; a failed update stops the run here
        return batch, {**metrics, **batch_metrics(batch, self.multi_domain)}

    def step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        batch, metrics = self.collect()
        t_rollout = time.perf_counter() - t0
        dist_loss, dist_penalty = self.dist_loss, self.dist_penalty
        temperature = self.config.rollout.temperature
        if self.reference is not None and "ref_log_probs" not in batch:  # unless the scheduler streamed them
            self.roles.use(self.reference.resident_role)
            ref, ref_dist = log_probs(self.executor, self.reference, batch, temperature, dist_loss or dist_penalty)
            batch.update(ref_log_probs=ref, **({"ref_log_dist": ref_dist} if ref_dist is not None else {}))
        t_old = time.perf_counter()
        if not (self.reusable_old and single_mini_batch(self.config.algorithm, len(batch))):
            self.roles.use("actor_train")
            old, old_dist = log_probs(self.executor, self.actor, batch, temperature, dist_penalty)
            batch.update(old_log_probs=old, **({"old_log_dist": old_dist} if old_dist is not None else {}))
        t_old = time.perf_counter() - t_old
        if self.critic is not None:
            self.roles.use("critic")
            batch.update(values=values(self.executor, self.critic, batch))
        metrics.update(self.shaper.shape(batch))
        metrics.update(self.reward.pop_failures())
        batch.tensors.pop("old_log_dist", None)
        if not dist_loss:
            batch.tensors.pop("ref_log_dist", None)
        t1 = time.perf_counter()
        self.dump_rollouts(step, batch)
        self.roles.use(*self._trained())
        # Under the hybrid engine the weight hand-over is one more call on the trainer's workers:
        # sent now, it runs right after the update instead of after the driver's next round trip.
        # The next step's generation can queue behind it too, unless a checkpoint comes first (its
        # prompts and random draws belong after the checkpoint). Each worker gets its calls as one
        # task, so the driver sleeps until the generation is done, instead of waking for the update's
        # metrics on the cores that generate.
        early_push = self.weights.queues_behind_update and not self.overlapping
        epoch = self.stream.epoch
        with self.executor.one_task_per_worker():
            pending_critic = start_update(self.critic, batch, *self.critic_update) if self.critic is not None else None
            pending_actor = start_update(self.actor, batch, *self.actor_update)
            if early_push:
                self.push_weights(policy_update=True)
                if self.ordered_infer and not self.saves_after(step):
                    self.scheduler.prefetch()
        metrics.update(self.scheduler.wait(pending_actor[0]))  # a scheduler may generate meanwhile
        self.executor.get(pending_actor[1:])
        if pending_critic is not None:
            metrics.update(self.executor.get(pending_critic)[0])
        t_train = time.perf_counter() - t1
        # an update sent with the calls behind it returned with them: its own seconds, as timed by its workers
        chained = [s for s in map(self.executor.call_seconds, [*pending_actor, *(pending_critic or [])]) if s is not None]
        if chained:
            t_train = max(chained)
        t2 = time.perf_counter()
        if not early_push:
            self.push_weights(policy_update=True)
        metrics.update({"data/epoch": epoch, "time/rollout_s": t_rollout, "time/train_s": t_train,
                        "time/weight_sync_s": time.perf_counter() - t2, "time/step_s": time.perf_counter() - t0,
                        "weight_sync/bytes": float(self.weights.bytes_per_update),
                        **self.roles.residency.metrics()})
        metrics.update(idle_times(metrics["time/step_s"], t_train, t_old, metrics.get("time/generate_s"),
                                  self.overlapping))
        return metrics

    def push_weights(self, policy_update: bool = False) -> None:
        """actor_train's weights to every actor_infer worker. After an RL update the driver does not
        wait for them: with a scheduler that overlaps training the update is queued behind the
        requests already sent (and awaited at the next push); with a synchronous one it is awaited
        by :meth:`settle_weights` when the next samples are in, so the broadcast overlaps the
        driver's logging and the next step's dispatch."""
        self.roles.use("actor_train", "actor_infer")
        self.weights.update(new_version=policy_update, wait=not policy_update)
        if policy_update:
            self.scheduler.weights_pushed()

    def settle_weights(self) -> None:
        """Wait for the weight update a synchronous step left queued (its errors surface here)."""
        if not self.overlapping:
            self.weights.finish()

    def _trained(self) -> dict:
        return {"actor_train": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy with greedy decoding (mean verifiable reward, per domain too), scored by
        ``roles.eval_reward`` where the run has one."""
        if not self.eval_rows:
            return {}
        self.roles.use("actor_infer")
        self.settle_weights()
        self.phase = "held-out evaluation"
        return heldout_accuracy(self.scheduler, self.eval_rows, self.reward, self.eval_reward)

    # -- checkpoints ------------------------------------------------------------------------------
    def write_checkpoint(self, tmp: Path) -> dict:
        self.settle_weights()
        self.roles.use(*self._trained())
        self.executor.get([h for name, group in self._trained().items()
                           for h in group.call("save_checkpoint", str(tmp / name))])
        for name in self._trained():
            save_tokenizer_beside(self.tokenizer, tmp / name)
        self.roles.save_rng("actor_infer", tmp / "infer_rng.pt")
        return {"data": self.stream.state(), "before_rl": self.before_rl, "shaping": self.shaper.state_dict()}

    def restore(self, path: Path, state: dict) -> None:
        self._spawn_policy_copies(self.start_model())
        self.executor.get([h for name, group in self._trained().items()
                           for h in group.call("load_checkpoint", str(path / name))])
        self.roles.load_rng("actor_infer", path / "infer_rng.pt")
        self.stream.load_state(state["data"])
        self.before_rl = state["before_rl"]
        self.shaper.load_state_dict(state["shaping"])
        self.executor.get(self.rebase_inference())
        self.push_weights()

    def summary(self, final_step: int, after: dict[str, float]) -> dict:
        return accuracy_summary(self.before_rl, after, final_step)
