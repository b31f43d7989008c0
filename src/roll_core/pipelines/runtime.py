"""The runtime every pipeline stands on: role groups and the training loop.

A pipeline is a subclass of :class:`TrainingLoop` that says what one step is. The loop owns the
rest, in this order (each name is a method a pipeline may override)::

    run()
      refuse to resume from a checkpoint of a different config      (before anything is written)
      prepare()                          once per run: tokenizer, data, checks
      roles.place()                      check device mappings against the cluster, reserve nodes
      attempt, again after a lost worker (runtime.max_restarts):
        build()                          spawn and set up the workers
        restore(latest) | begin()        resume, or start: step-0 metrics, then checkpoint step 0
        before_steps()
        for step: step(step) -> metrics  [evaluate() every trainer.eval_every] -> trackers -> save
        after_steps()
      summary(final_step, evaluation)    -> summary.json

:class:`RoleGroups` spawns a role's workers where its device mapping says, joins a trained role's
data-parallel group, time-shares colocated roles (:class:`~roll_core.runtime.placement.Residency`)
and switches thread counts between phases. ``rlvr`` (RL with verifiable rewards) and ``sft``
(supervised fine-tuning) are the two pipelines built on it; ``sft`` is the shortest worked example.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from abc import abstractmethod
from pathlib import Path
from typing import Any, Callable

import torch

from roll_core.algorithms.objective import reference_read
from roll_core.config.resume import check_resume
from roll_core.data import Batch
from roll_core.embedded.model import build_tiny_model
from roll_core.errors import ConfigError
from roll_core.multimodal import save_processor
from roll_core.pipelines import Pipeline
from roll_core.pipelines.checkpoint import CheckpointManager
from roll_core.pipelines.rollout_dump import write_dump
from roll_core.plugins import get_plugins
from roll_core.runtime.executor import LocalExecutor, WorkerGroup
from roll_core.runtime.progress import reporting
from roll_core.runtime.restarts import run_restarting
from roll_core.runtime.placement import (Residency, check_cluster, colocated, hybrid_engine, nodes_needed,
                                         worker_slots)
from roll_core.rollout.rewards import RewardRouter
from roll_core.runtime.reward_worker import RewardWorker
from roll_core.runtime.workers import STRATEGY_WORKERS
from roll_core.training import policy_gradient_update

# Every role's workers, and the warm-up's data order, draw from seeds of their own, offset from the
# run's ``seed`` (actor_train uses it as is, the training data order too), so that no two share a
# random stream and worker r of a role gets offset + r. Changing a value changes every run's numbers.
SEED_OFFSETS = {"actor_train": 0, "actor_infer": 1000, "reference": 2000, "critic": 3000, "warmup_data": 7,
                "preference_data": 11, "distill_data": 13}

# Seconds between the lines that say a role start is still going (:func:`~roll_core.runtime.progress.reporting`):
# the tiny model's roles start within them and print nothing.
START_REPORT_S = 20.0


def load_tokenizer(model_path: str, chat_template: str | None = None):
    """The model's tokenizer (EOS pads when it has no pad token), with ``data.chat_template`` installed."""
    from transformers import AutoTokenizer

    from roll_core.chat import use_template

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    use_template(tokenizer, chat_template)
    return tokenizer


class RoleGroups:
    """The run's worker groups by role name, where they run and which of them holds the devices."""

    def __init__(self, config, executor, plugins):
        self.config, self.executor, self.plugins = config, executor, plugins
        self.groups: dict[str, WorkerGroup] = {}
        self.per_node, self.node_ids = 0, []
        self.residency = Residency(executor, self.groups, colocated(config))
        # Workers in the driver's own process whatever the executor: rewards scored there and the
        # agentic validation environments. The run's executor does not know them, so they are
        # closed here (the environments' ``close``), at a restart and at the run's end.
        self.driver = LocalExecutor()

    def place(self) -> None:
        """Check the device mappings against the cluster and reserve its nodes (before any worker)."""
        cfg = self.config
        self.per_node = check_cluster(cfg, self.executor.gpus_by_node()) if cfg.executor == "ray" else 0
        if self.per_node:
            self.node_ids = self.executor.reserve_devices(nodes_needed(cfg, self.per_node), self.per_node)
            layout = ", ".join(f"{name} {role.devices}" for name, role in cfg.placed_roles().items() if role.devices)
            pairs = sorted({tuple(sorted((a, b))) for a, bs in colocated(cfg).items() for b in bs})
            mode = "colocated " + ", ".join("+".join(p) for p in pairs) if pairs else "disaggregated"
            print(f"placement on {len(self.node_ids)} node(s) x {self.per_node} devices: {layout} ({mode})", flush=True)

    def reset(self) -> None:
        """Forget every group (a new attempt after a lost worker spawns them again)."""
        self.close()
        self.groups.clear()
        self.residency = Residency(self.executor, self.groups, colocated(self.config))

    def close(self) -> None:
        """Close the workers in the driver (:attr:`driver`); the run's executor stops its own."""
        self.driver.shutdown()

    def spawn(self, name: str, cls: type, args_per_worker: list[tuple], role_cfg, concurrency: int = 1) -> WorkerGroup:
        """Spawn a role's workers where its device mapping says (CPU workers without one)."""
        slots = worker_slots(role_cfg, self.per_node) if self.per_node and role_cfg.devices else None
        args = [(*a, slots[i].local_devices if slots else None) for i, a in enumerate(args_per_worker)]
        group = self.executor.spawn(name, cls, args, slots, concurrency=concurrency)
        self.groups[name] = group
        return group

    def model_role(self, name: str, model_path: str, role_cfg=None) -> WorkerGroup:
        """Spawn and set up the model role at key ``roles.<name>`` (or ``role_cfg``): its kind's worker
        (train, infer or critic), ``num_workers`` times; actor_infer's inside actor_train's process
        under the hybrid engine (:func:`~roll_core.runtime.placement.hybrid_engine`). Workers that
        hold one model between them (trained roles, and an inference engine that declares
        ``sharded``) first join one process group. Workers of an engine that declares
        ``concurrent_requests`` run ``rollout.max_running_requests`` calls at once.

        Seeds: ``seed + SEED_OFFSETS[name]`` (0 for actor_train; a role of one's own: 10,000 plus a
        hash of its name below 10,000); the workers of one model share it, worker r of an inference
        role draws from that plus r."""
        return self.model_roles((name, model_path, role_cfg))[0]

    def model_roles(self, *roles: tuple[str, str] | tuple[str, str, Any]) -> list[WorkerGroup]:
        """:meth:`model_role` for several ``(name, model_path[, role_cfg])`` at once: every role's
        workers are spawned before any is set up, so on Ray their processes start, import and load
        their models side by side instead of one role after the other (most of a worker's start is
        importing torch and transformers: about 7 s a role on 2 cores)."""
        if not roles:
            return []
        configured = [(name, path, given[0] if given and given[0] is not None else self.config.role(name))
                      for name, path, *given in roles]
        names = " and ".join(f"{name} ({cfg.num_workers} worker{'s' if cfg.num_workers > 1 else ''})"
                             for name, _, cfg in configured)
        with reporting(f"starting {names}", START_REPORT_S):  # a large model loads for minutes
            spawned = [self._spawn_model_role(*role) for role in configured]
            ex = self.executor
            worlds = [len(group) if one_model else 1 for group, one_model in spawned]
            # the workers of one model join one process group at the address of its first worker's node
            asked = {group.role: ex.invoke(group.handles[0], "node_address", (), {})
                     for (group, _), world in zip(spawned, worlds) if world > 1}
            addresses = {role: ex.get(future) for role, future in asked.items()}
            setups = [[ex.invoke(h, "setup", (addresses.get(group.role), rank if world > 1 else 0, world), {})
                       for rank, h in enumerate(group.handles)] for (group, _), world in zip(spawned, worlds)]
            for (group, one_model), futures in zip(spawned, setups):
                dp_ranks = ex.get(futures)
                if one_model:  # other inference workers keep the default: each one a replica of its own
                    group.dp_ranks = dp_ranks
        return [group for group, _ in spawned]

    def _spawn_model_role(self, name: str, model_path: str, role_cfg) -> tuple[WorkerGroup, bool]:
        """The role's workers, spawned and not yet set up, and whether they hold one model between them."""
        kind = role_cfg.kind
        base = self.config.seed + SEED_OFFSETS.get(name, 10_000 + zlib.crc32(name.encode()) % 10_000)
        engine = self.plugins.infer_strategies.get(role_cfg.strategy) if kind == "infer" else None
        one_model = kind in ("train", "critic") or getattr(engine, "sharded", False)
        seeds = [base if one_model else base + r for r in range(role_cfg.num_workers)]
        concurrent = getattr(engine, "concurrent_requests", False)
        args = [(name, model_path, role_cfg, self.config, seed) for seed in seeds]
        if name == "actor_infer" and "actor_train" in self.groups and hybrid_engine(self.config):
            group = self.groups[name] = self.executor.spawn_hosted(name, STRATEGY_WORKERS[kind], args,
                                                                   self.groups["actor_train"])
        else:
            group = self.spawn(name, STRATEGY_WORKERS[kind], args, role_cfg,
                               self.config.rollout.max_running_requests if concurrent else 1)
        return group, one_model

    def reference(self, actor: WorkerGroup, policy_path: str) -> WorkerGroup:
        """``roles.reference``, the frozen policy (``policy_path``) or the model it names. Under LoRA,
        without a ``model_path`` of its own, it is actor_train's base model: actor_train's workers
        with the adapters disabled, no second copy loaded."""
        reference, _ = self.policy_copies(actor, policy_path, reference=True)
        assert reference is not None
        return reference

    def policy_copies(self, actor: WorkerGroup, policy_path: str, reference: bool,
                      critic=None) -> tuple[WorkerGroup | None, WorkerGroup | None]:
        """The roles that start from the policy RL begins with: the reference where ``reference``
        (:meth:`reference`) and the critic where ``critic`` (its role config) is given, those with
        workers of their own started side by side (:meth:`model_roles`)."""
        own: list[tuple[str, str, Any]] = []
        on_actor = reference and self.config.reference_on_actor()
        if reference and not on_actor:
            cfg = self.config.roles.reference
            own.append(("reference", cfg.model_path or policy_path, cfg))
        if critic is not None:
            own.append(("critic", policy_path, critic))
        started = {group.role: group for group in self.model_roles(*own)}
        if on_actor:
            started["reference"] = actor.as_role("reference", compute_log_probs="base_log_probs")
        return started.get("reference"), started.get("critic")

    def rewards(self) -> RewardRouter:
        """Spawn the default reward role (``roles.reward``) and one per domain (``roles.domain_rewards``),
        each on its own workers or in the driver (:meth:`scores_in_driver`); raises at once if a
        reward rejects its options (before any model loads)."""
        default = self._reward_group("reward", "roles.reward")
        by_domain = {d: self._reward_group(f"reward/{d}", f"roles.domain_rewards.{d}")
                     for d in self.config.roles.domain_rewards}
        router = RewardRouter(default, by_domain)
        router.ready()
        return router

    def eval_rewards(self) -> RewardRouter | None:
        """Spawn ``roles.eval_reward``, which scores held-out evaluations, as :meth:`rewards` spawns
        the others; None when the run has none (the training rewards score them)."""
        if self.config.roles.eval_reward is None:
            return None
        router = RewardRouter(self._reward_group("eval_reward", "roles.eval_reward"))
        router.ready()
        return router

    def _reward_group(self, name: str, key: str) -> WorkerGroup:
        """The workers of the reward role at config ``key``, or its one worker in the driver."""
        spec, entries = self.config.roles.reward_roles()[key]
        rewards = [(r.name, r.options, r.weight) for r in entries]
        # models_here: the local executor's one process (also the controller's inside a Ray worker)
        args = (rewards, self.config, key, spec.failure_policy(), isinstance(self.executor, LocalExecutor))
        if scores_in_driver(spec, [r.name for r in entries], self.plugins.rewards):  # no devices
            group = self.driver.spawn(name, RewardWorker, [(*args, None)] * spec.num_workers)
            self.groups[name] = group
            return group
        return self.spawn(name, RewardWorker, [args] * spec.num_workers, spec)

    def use(self, *names: str) -> None:
        """Make these roles resident (offloading colocated ones first)."""
        self.residency.use(*names)

    def set_threads(self, rl: bool) -> None:
        """Roles with their own ``torch_threads`` use it during RL steps, when roles may run at
        once (an async trainer beside generation), and the run's count otherwise, when one role
        works alone (warm-up, evaluation) and may take every core."""
        futures, roles = [], self.config.roles.named()
        for name, group in self.groups.items():
            threads = getattr(roles.get(name), "torch_threads", None)
            if threads is not None:
                futures += group.call("set_threads", threads if rl else self.config.torch_threads)
        self.executor.get(futures)

    def save_rng(self, name: str, path: Path) -> None:
        """The sampling RNG state of every worker of role ``name`` (a resumed run draws the same samples)."""
        torch.save({name: self.executor.get(self.groups[name].call("rng_state"))}, path)

    def load_rng(self, name: str, path: Path) -> None:
        """Inverse of :meth:`save_rng`; the role must have as many workers as when it was saved."""
        states, group = torch.load(path, weights_only=False)[name], self.groups[name]
        if len(states) != len(group):
            raise ConfigError(f"checkpoint {path.parent} has {len(states)} {name} workers, config has {len(group)}")
        self.executor.get([self.executor.invoke(h, "set_rng_state", (s,), {}) for h, s in zip(group.handles, states)])

    def record(self, path: Path) -> None:
        """``placement.json``: the reserved nodes, the driver's pid and where every worker landed (pid, node,
        devices, the CPU linear-layer kernel; a reward role that scores in the driver has the driver's pid)."""
        where = {name: group.executor.get(group.call("placement")) for name, group in self.groups.items()}
        path.write_text(json.dumps({"nodes": self.node_ids, "driver_pid": os.getpid(), "roles": where}, indent=2))


def scores_in_driver(spec, reward_names: list[str], registry) -> bool:
    """Whether a reward role (``spec``, with these rewards from ``registry``) scores in the driver
    process: by its ``placement``, or under ``auto`` when it is one CPU worker of lightweight rewards
    only (:attr:`~roll_core.rewards.Reward.lightweight`). A string comparison then costs no round
    trip to another process: on the quickstart a reward worker's call took 3-4 ms of a 0.08 s step
    against 0.4 ms inline. (On the local executor every worker is in the driver anyway.)"""
    if spec.placement != "auto":
        return spec.placement == "driver"
    return (spec.num_workers == 1 and spec.device_mapping is None
            and all(getattr(registry.get(name), "lightweight", False) for name in reward_names))


def log_probs(executor, group: WorkerGroup, batch: Batch, temperature: float,
              distribution: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token log-probs ``[B, R]`` of the responses under ``group``'s model, each data-parallel replica
    taking an equal slice, and with ``distribution`` the full log-distributions ``[B, R, V]`` from the
    same pass."""
    parts = executor.get(group.per_replica("compute_log_probs", batch, temperature=temperature,
                                           distribution=distribution))
    width = batch["responses"].shape[1]
    pad = (lambda p: (0, 0, 0, width - p.shape[1])) if distribution else (lambda p: (0, width - p.shape[1]))
    out = torch.cat([torch.nn.functional.pad(p, pad(p)) for p in parts])
    if not distribution:
        return out, None
    return out.gather(-1, batch["responses"][..., None]).squeeze(-1), out


def values(executor, critic: WorkerGroup, batch: Batch) -> torch.Tensor:
    """The critic's values ``[B, R]`` of the responses, each data-parallel replica taking an equal slice."""
    return torch.cat(executor.get(critic.per_replica("compute_values", batch)))


def start_update(group: WorkerGroup, batch: Batch, loss_fn, spec) -> list:
    """Start one update (:func:`roll_core.training.update`) on every worker of a trained role, each
    with its data-parallel share of every mini-batch; returns the futures of their metrics."""
    return group.data_parallel("update", batch, mini_batch_size=spec.mini_batch_size, loss_fn=loss_fn, spec=spec)


class TrainingLoop(Pipeline):
    """Resume, trackers, evaluation, checkpoints and restarts around an abstract :meth:`step`."""

    step_label = "step"  # what ``phase`` calls a step ("RL step 3 of 10")
    tokenizer: Any  # the policy's, set by prepare()

    def __init__(self, config, executor):
        super().__init__(config, executor)
        self.plugins = get_plugins()
        self.run_dir = Path(config.output_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", config.trainer.keep_checkpoints)
        self.roles = RoleGroups(config, executor, self.plugins)

    # -- what a pipeline says -------------------------------------------------------------------
    @property
    def max_steps(self) -> int:
        return self.planned_steps(self.config)

    def saves_after(self, step: int) -> bool:
        """Whether a checkpoint is written after ``step`` (every ``trainer.save_every`` and the last)."""
        every = self.config.trainer.save_every
        return step == self.max_steps or bool(every and step % every == 0)

    def prepare(self) -> None:
        """Once per run, before any worker starts: tokenizer, data, checks that need them."""

    @abstractmethod
    def build(self) -> None:
        """Spawn and set up the workers (again after a lost worker)."""

    def begin(self) -> dict[str, float]:
        """A fresh start, before step 1; returns the metrics logged at step 0."""
        return {}

    @abstractmethod
    def step(self, step: int) -> dict[str, float]:
        """One training step; returns its metrics."""

    def evaluate(self) -> dict[str, float]:
        return {}

    def before_steps(self) -> None:
        """After building and resuming or beginning, before the first step of this attempt."""

    def after_steps(self) -> None:
        """After the last step of the run (not after a lost worker)."""

    @abstractmethod
    def write_checkpoint(self, tmp: Path) -> dict:
        """Fill checkpoint directory ``tmp``; returns the driver state that goes into ``state.json``."""

    @abstractmethod
    def restore(self, path: Path, state: dict) -> None:
        """Inverse of :meth:`write_checkpoint`."""

    def summary(self, final_step: int, evaluation: dict[str, float]) -> dict:
        return {"steps": final_step, "evaluation": evaluation}

    def dump_rollouts(self, step: int, batch: Batch) -> None:
        """Write ``batch``, the step's training batch, every ``trainer.dump_rollouts_every`` steps
        (:mod:`roll_core.pipelines.rollout_dump`); a step replayed after a resume overwrites its dump."""
        every = self.config.trainer.dump_rollouts_every
        if every and step % every == 0:
            write_dump(self.run_dir, step, batch, self.tokenizer)

    # -- the loop --------------------------------------------------------------------------------
    def model_path(self) -> str:
        """``model.path``, or the embedded tiny model built into the run directory."""
        if self.config.model.path == "tiny":
            return str(build_tiny_model(self.run_dir / "tiny-model", self.config.model.tiny))
        return self.config.model.path

    def policy(self) -> tuple[str, Any]:
        """The policy's model directory (:meth:`model_path`) and its tokenizer, with the run's chat template."""
        path = self.model_path()
        return path, load_tokenizer(path, self.config.data.chat_template)

    def save(self, step: int) -> Path:
        state = {"seed": self.config.seed, "config": self.config.model_dump(mode="json")}
        return self.checkpoints.save(step, self.write_checkpoint, state)

    def resume_hint(self) -> str:
        return self.checkpoints.resume_point()

    def run(self) -> dict:
        cfg = self.config
        problems = self.config_problems(cfg, self.plugins)  # again: a pipeline built in Python skips the loader
        if problems:
            raise ConfigError("config error in the config: " + "; ".join(problems))
        latest = self.checkpoints.latest() if cfg.trainer.resume == "auto" else None
        if latest is not None:  # before anything is written or started
            check_resume(self.checkpoints.load_state(latest).get("config"), cfg.model_dump(mode="json"), latest,
                         lambda flat: self.resume_view(flat, self.plugins))
        (self.run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
        self.prepare()
        self.roles.place()
        trackers = [self.plugins.trackers.get(name)(self.run_dir, cfg) for name in cfg.trackers]
        try:
            summary, restarts = run_restarting(
                lambda restarts: self._attempt(trackers, resume=restarts > 0 or cfg.trainer.resume == "auto"),
                self.checkpoints, cfg.runtime.max_restarts, before_restart=self.executor.kill_all)
        finally:
            self.roles.close()
            for t in trackers:
                t.close()
        summary["restarts"] = restarts
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _attempt(self, trackers: list, resume: bool) -> dict:
        cfg = self.config
        self.roles.reset()
        self.build()
        start = 0
        latest = self.checkpoints.latest() if resume else None
        if latest is not None:
            state = self.checkpoints.load_state(latest)
            self.restore(latest, state)
            start = int(state["step"])
            print(f"resumed from {latest} at step {start}", flush=True)
            for t in trackers:
                t.rewind(start)  # the steps after the checkpoint are replayed: each is written once
        else:
            first = self.begin()
            for t in trackers:
                t.rewind(-1)
                t.log(first, 0)
            self.save(0)
        self.before_steps()
        last_eval, last_eval_step = {}, None
        since = time.perf_counter()  # start of the current iteration (the loop's own work included)
        for step in range(start + 1, self.max_steps + 1):
            self.phase = f"{self.step_label} {step} of {self.max_steps}"
            metrics = self.step(step)
            ended = time.perf_counter()
            # wall seconds per step as a user sees them: the step and the loop's logging (which the
            # step metrics cannot time: it comes after them), not evaluation or checkpoints
            metrics["time/iteration_s"] = ended - since
            if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
                last_eval, last_eval_step = self.evaluate(), step
                metrics.update(last_eval)
            evaluated = time.perf_counter()
            for t in trackers:
                t.log(metrics, step)
            logged = time.perf_counter()
            if self.saves_after(step):
                self.save(step)
            since = time.perf_counter() - (logged - evaluated)  # the next iteration starts with this logging
        self.after_steps()
        final_step = max(start, self.max_steps)
        return self.summary(final_step, last_eval if last_eval_step == final_step else self.evaluate())


class ActorLoop(TrainingLoop):
    """A pipeline that trains one role, ``actor_train`` unless ``trained_role`` says otherwise, on a
    seeded stream of rows (``sft``, ``dpo``, ``distill``; ``reward_model`` trains ``critic``): its
    checkpoint is that role's (with the tokenizer, so ``model/`` loads whole), the stream's position
    and the step-0 evaluation, and its summary prints ``headline`` before and after. A subclass sets
    ``self.actor`` (the trained role's workers), ``self.tokenizer`` and ``self.stream`` and says what
    a step and an evaluation are."""

    #: (metric, how it is called, its format, what a step is), e.g. ("eval/loss", "held-out loss", "{:.3f}", "SFT steps")
    headline: tuple[str, str, str, str]
    trained_role = "actor_train"  # its key in roles, and its directory in each checkpoint
    actor: WorkerGroup
    stream: Any  # roll_core.data.PromptStream
    before: dict[str, float]

    def begin(self) -> dict[str, float]:
        self.before = self.evaluate()
        return self.before

    def write_checkpoint(self, tmp: Path) -> dict:
        self.executor.get(self.actor.call("save_checkpoint", str(tmp / self.trained_role)))
        save_tokenizer_beside(self.tokenizer, tmp / self.trained_role)
        return {"data": self.stream.state(), "before": self.before}

    def restore(self, path: Path, state: dict) -> None:
        self.executor.get(self.actor.call("load_checkpoint", str(path / self.trained_role)))
        self.stream.load_state(state["data"])
        self.before = state["before"]

    def summary(self, final_step: int, evaluation: dict[str, float]) -> dict:
        key, label, fmt, steps = self.headline
        if key in self.before and key in evaluation:
            print(f"{label}: {fmt.format(self.before[key])} -> {fmt.format(evaluation[key])} after {final_step} "
                  f"{steps}", flush=True)
        return {"steps": final_step, "before": self.before, "after": evaluation}


class PolicyGradientLoop(TrainingLoop):
    """A loop that updates the policy with the core's policy-gradient objective on the samples it
    collects (``rlvr``, ``agentic``): ``roll replay`` re-runs that update from a run's dumps, and
    ``roles.reference`` starts only where the objective reads it (a KL term, or its metric)."""

    policy_update: Callable[[Any, Any], tuple[Any, Any]] | None = staticmethod(policy_gradient_update)

    @classmethod
    def starts_reference(cls, cfg, plugins) -> bool:
        return cfg.roles.reference is not None and reference_read(cfg.algorithm, plugins)


def save_tokenizer_beside(tokenizer, checkpoint: Path) -> None:
    """The tokenizer (and image processor) into a trained role's checkpoint ``model/`` and
    ``adapter/``, so each loads whole (transformers, peft)."""
    for saved in ("model", "adapter"):
        if (checkpoint / saved).is_dir():
            save_tokenizer(tokenizer, checkpoint / saved)


def save_tokenizer(tokenizer, directory: Path) -> None:
    """``tokenizer`` (the run's, chat template included) into a model ``directory``, with the image
    processor of the model it came from where that has one (:mod:`roll_core.multimodal`)."""
    source = getattr(tokenizer, "name_or_path", "")  # where it was loaded from ("" for one built in memory)
    if source:
        save_processor(source, directory)
    tokenizer.save_pretrained(directory)


def warn_if_oversubscribed(cfg) -> None:
    """Generation and training at once (a scheduler that overlaps training) on CPU workers with more
    intra-op threads than cores between them slow each other down (measured on 2 cores with 2 + 2
    threads: a step 4x slower with OpenMP's spinning waits, which the Ray executor turns off for such
    schedulers, and still 1.1x slower without them); say so instead of letting the run look slow."""
    import os

    if cfg.executor != "ray" or torch.cuda.is_available():
        return
    cores = os.cpu_count() or 1
    train, infer = cfg.roles.actor_train, cfg.roles.actor_infer
    train_threads, infer_threads = cfg.rl_threads("actor_train"), cfg.rl_threads("actor_infer")
    busy = train_threads * train.num_workers + infer_threads * infer.num_workers
    if busy > cores:
        print(f"warning: async training on CPU runs {train.num_workers} actor_train worker(s) with {train_threads} "
              f"thread(s) and {infer.num_workers} actor_infer worker(s) with {infer_threads} at once ({busy} threads "
              f"on {cores} cores); oversubscribed cores make both slower. Set torch_threads={max(1, cores // 2)} "
              f"or fewer (or per role: roles.<role>.torch_threads).", flush=True)
