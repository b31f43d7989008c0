"""``rlvr``: reinforcement learning with verifiable rewards, driven by a single controller.

One step::

    prompts -> rollout (generate groups on actor_infer, score on reward workers)
            [-> dynamic sampling: drop groups that fail the filter, draw more prompts]
            -> reference and old log-probs [, critic values]
            -> reward shaping and advantages (roll_core.algorithms.shaping, in its documented order)
            -> policy update on actor_train [, value update on critic]
            -> weight sync to actor_infer -> metrics -> checkpoint

Before RL, an optional supervised warm-up imitates the data's demonstrations, and held-out accuracy
(greedy decoding) is measured before and after RL. Runs resume from the latest checkpoint in
``output_dir``: step counter, data position, optimizer, sampling RNG and the before-RL numbers.

Roles are placed by their ``device_mapping`` (:mod:`roll_core.runtime.placement`): colocated roles
are offloaded and reloaded around each use, trained roles with several workers train
data-parallel, and when a worker process dies the run restarts its workers from the last
checkpoint (``runtime.max_restarts``).

Run it: ``roll run`` (the embedded default) or ``roll run my.yaml key=value ...``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from roll_core.algorithms.objective import kl_takes_distribution, needs_distribution, reuses_update_log_probs
from roll_core.algorithms.shaping import RewardShaper, keep_groups
from roll_core.config.resume import check_resume
from roll_core.data import Batch, DomainMixer, PromptStream, dp_shards, read_jsonl
from roll_core.embedded.model import build_tiny_model
from roll_core.errors import ConfigError, RollError, WorkerLostError, did_you_mean
from roll_core.pipelines import Pipeline
from roll_core.pipelines.checkpoint import CheckpointManager
from roll_core.rollout.rewards import RewardRouter
from roll_core.rollout.sync import tokenize_prompts
from roll_core.plugins import get_plugins
from roll_core.runtime.placement import Residency, check_cluster, colocated, nodes_needed, worker_slots
from roll_core.runtime.workers import RewardWorker, RoleWorker


# Every role's workers, and the warm-up's data order, draw from seeds of their own, offset from the
# run's ``seed`` (actor_train uses it as is, the training data order too), so that no two share a
# random stream and worker r of a role gets offset + r. Changing a value changes every run's numbers.
SEED_OFFSETS = {"actor_infer": 1000, "reference": 2000, "critic": 3000, "warmup_data": 7}


def _progress(total: int, description: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
    task = progress.add_task(description, total=total, info="")
    return progress, task


def rows_by_domain(batch: Batch) -> dict[str, list[int]]:
    """Row indices of each domain, domains sorted by name."""
    out: dict[str, list[int]] = {}
    for i, d in enumerate(batch["domain"]):
        out.setdefault(d, []).append(i)
    return dict(sorted(out.items()))


def reward_stats(scores: torch.Tensor) -> dict[str, float]:
    return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0}


def domain_metrics(batch: Batch) -> dict[str, float]:
    """Per-domain reward, accuracy (share of samples with score >= 1), response length and sample
    count, plus the mean of every reward component of a domain scored by several rewards."""
    out: dict[str, float] = {}
    lengths = batch["response_mask"].sum(-1).float()
    for d, idx in rows_by_domain(batch).items():
        scores = batch["scores"][idx]
        out[f"reward/{d}/mean"] = float(scores.mean())
        out[f"reward/{d}/accuracy"] = float((scores >= 1.0).float().mean())
        out[f"response_length/{d}/mean"] = float(lengths[idx].mean())
        out[f"samples/{d}"] = float(len(idx))
        parts = [batch["reward_components"][i] for i in idx] if "reward_components" in batch else []
        if parts and len(parts[0]) > 1:
            for name in parts[0]:
                out[f"reward/{d}/{name}"] = sum(p[name] for p in parts) / len(parts)
    return out


class RLVRPipeline(Pipeline):
    def __init__(self, config, executor):
        super().__init__(config, executor)
        self.plugins = get_plugins()
        self.run_dir = Path(config.output_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", config.trainer.keep_checkpoints)

    # ------------------------------------------------------------------------------------------
    # set-up
    # ------------------------------------------------------------------------------------------
    def _model_path(self) -> str:
        if self.config.model.path == "tiny":
            return str(build_tiny_model(self.run_dir / "tiny-model", self.config.model.tiny))
        return self.config.model.path

    def _read_source(self, source, key: str) -> tuple[list[dict], list[dict]]:
        """Train and held-out rows of a data config (``data`` or one of ``data.domains``)."""
        if source.train_file:
            return read_jsonl(source.train_file), (read_jsonl(source.eval_file) if source.eval_file else [])
        factory = self.plugins.datasets.get(source.dataset)
        try:
            built = factory(source.options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"key '{key}.options' for dataset '{source.dataset}': {exc}") from None
        return built.train_rows(), built.eval_rows()

    def _load_data(self) -> tuple[list[dict], list[dict]]:
        data = self.config.data
        if not data.domains:
            train, evals = self._read_source(data, "data")
            return train, evals[: data.eval_size] if data.eval_size else evals
        train, evals = [], []
        for domain, source in data.domains.items():
            t, e = self._read_source(source, f"data.domains.{domain}")
            train += [{**row, "domain": domain} for row in t]
            evals += [{**row, "domain": domain} for row in (e[: data.eval_size] if data.eval_size else e)]
        return train, evals

    def _check_domains(self) -> None:
        """Every domain with its own reward must occur in the data (a typo would silently fall back
        to the default reward)."""
        present = {row.get("domain", "default") for row in self.train_rows}
        for domain in self.config.roles.domain_rewards:
            if domain not in present:
                raise ConfigError(f"key 'roles.domain_rewards.{domain}': no training row has domain '{domain}'."
                                  f"{did_you_mean(domain, present)} The data has: {', '.join(sorted(present))}")

    def _place(self) -> None:
        """Check the device mappings against the cluster and reserve its nodes (before any worker)."""
        cfg = self.config
        self.per_node = check_cluster(cfg, self.executor.gpus_by_node()) if cfg.executor == "ray" else 0
        self.node_ids: list[str] = []
        if self.per_node:
            self.node_ids = self.executor.reserve_devices(nodes_needed(cfg, self.per_node), self.per_node)
            layout = ", ".join(f"{name} {role.devices}" for name, role in cfg.placed_roles().items() if role.devices)
            pairs = sorted({tuple(sorted((a, b))) for a, bs in colocated(cfg).items() for b in bs})
            mode = "colocated " + ", ".join("+".join(p) for p in pairs) if pairs else "disaggregated"
            print(f"placement on {len(self.node_ids)} node(s) x {self.per_node} devices: {layout} ({mode})", flush=True)

    def _start(self, name: str, cls: type, args_per_worker: list[tuple], role_cfg, concurrency: int = 1):
        """Spawn a role's workers where its device mapping says (CPU workers without one)."""
        slots = worker_slots(role_cfg, self.per_node) if self.per_node and role_cfg.devices else None
        args = [(*a, slots[i].local_devices if slots else None) for i, a in enumerate(args_per_worker)]
        group = self.executor.spawn(name, cls, args, slots, concurrency=concurrency)
        self.groups[name] = group
        return group

    def _setup(self, group, data_parallel: bool) -> None:
        """Build the strategies; the workers of a trained role first join one data-parallel group."""
        world = len(group) if data_parallel else 1
        address = self.executor.get(self.executor.invoke(group.handles[0], "node_address", (), {})) if world > 1 else None
        self.executor.get([self.executor.invoke(h, "setup", (address, rank if world > 1 else 0, world), {})
                           for rank, h in enumerate(group.handles)])

    def _spawn_workers(self, model_path: str) -> None:
        cfg, roles, seed = self.config, self.config.roles, self.config.seed
        self.groups: dict = {}
        self.actor = self._start("actor_train", RoleWorker,
                                 [("actor_train", "train", model_path, roles.actor_train, cfg, seed)
                                  for _ in range(roles.actor_train.num_workers)], roles.actor_train)
        self.infer = self._start(
            "actor_infer", RoleWorker,
            [("actor_infer", "infer", model_path, roles.actor_infer, cfg, seed + SEED_OFFSETS['actor_infer'] + r)
             for r in range(roles.actor_infer.num_workers)], roles.actor_infer, concurrency=self._infer_concurrency(),
        )
        default = self._start("reward", RewardWorker,
                              [([(roles.reward.name, roles.reward.options, 1.0)], cfg, "roles.reward",
                                roles.reward.failure_policy()) for _ in range(roles.reward.num_workers)], roles.reward)
        by_domain = {
            domain: self._start(
                f"reward/{domain}", RewardWorker,
                [([(r.name, r.options, r.weight) for r in spec.rewards], cfg, f"roles.domain_rewards.{domain}",
                  spec.failure_policy()) for _ in range(spec.num_workers)], spec,
            )
            for domain, spec in roles.domain_rewards.items()
        }
        self.reward = RewardRouter(self.executor, default, by_domain)
        self.reward.ready()  # a reward that rejects its options stops the run now, not after the warm-up
        self._setup(self.actor, data_parallel=True)
        self._setup(self.infer, data_parallel=False)
        self.reference = None
        self.critic = None
        self.residency = Residency(self.executor, self.groups, colocated(cfg))
        self._setup_weight_sync()

    def _infer_concurrency(self) -> int:
        """Calls at once per inference worker: ``max_running_requests`` for engines that batch
        concurrent requests themselves (``InferStrategy.concurrent_requests``), else one."""
        strategy = self.plugins.registry("infer_strategies").get(self.config.roles.actor_infer.strategy)
        return self.config.rollout.max_running_requests if getattr(strategy, "concurrent_requests", False) else 1

    def _trained_roles(self) -> tuple[str, ...]:
        return ("actor_train", "critic") if self.critic is not None else ("actor_train",)

    def _spawn_policy_copies(self, model_path: str) -> None:
        """Roles that start from the policy RL begins with (the warmed-up model): reference, critic."""
        ref, critic = self.config.roles.reference, self.config.roles.critic
        if ref is not None:
            # A reference with its own model_path is a different model (a distillation teacher).
            path = ref.model_path or model_path
            self.reference = self._start(
                "reference", RoleWorker,
                [("reference", "infer", path, ref, self.config, self.config.seed + SEED_OFFSETS['reference'] + r)
                 for r in range(ref.num_workers)], ref,
            )
            self._setup(self.reference, data_parallel=False)
        if critic is not None:
            self.critic = self._start("critic", RoleWorker,
                                      [("critic", "critic", model_path, critic, self.config, self.config.seed + SEED_OFFSETS['critic'])
                                       for _ in range(critic.num_workers)], critic)
            self._setup(self.critic, data_parallel=True)

    def _record_placement(self) -> None:
        """``placement.json``: the reserved nodes and where every worker landed (pid, node, devices)."""
        where = {name: self.executor.get(group.call("placement")) for name, group in self.groups.items()}
        (self.run_dir / "placement.json").write_text(json.dumps({"nodes": self.node_ids, "roles": where}, indent=2))

    def _setup_weight_sync(self) -> None:
        """``collective``: training rank 0 and every inference worker join one group and weights
        are broadcast bucket by bucket (nccl when both sides are on GPUs and not colocated, gloo
        otherwise); ``object_store``: buckets go through Ray's object store (memory when local)."""
        cfg = self.config.runtime
        mode = cfg.weight_sync
        if mode == "auto":
            mode = "collective" if self.config.executor == "ray" and not self.streaming else "object_store"
        self.weight_sync = mode
        self.bucket_bytes = int(cfg.weight_bucket_mb * 2**20)
        if mode != "collective":
            return
        members = [self.actor.handles[0], *self.infer.handles]
        devices = self.executor.get([self.executor.invoke(h, "device_type", (), {}) for h in members])
        split = "actor_infer" not in colocated(self.config).get("actor_train", set())
        backend = "nccl" if split and all(d == "cuda" for d in devices) else "gloo"
        address = self.executor.get(self.executor.invoke(members[0], "node_address", (), {}))
        self.executor.get([self.executor.invoke(h, "join_weight_group", (address, rank, len(members), backend), {})
                           for rank, h in enumerate(members)])
        self.weight_meta = self.executor.get(self.actor.call("weight_meta", self.bucket_bytes))[0]

    def _make_trackers(self) -> list:
        return [self.plugins.trackers.get(name)(self.run_dir, self.config) for name in self.config.trackers]

    # ------------------------------------------------------------------------------------------
    # building blocks
    # ------------------------------------------------------------------------------------------
    def sync_weights(self, policy_update: bool = False) -> None:
        """Push actor_train's weights to every actor_infer worker, in buckets (see
        :meth:`_setup_weight_sync`). Every training rank takes part (sharded strategies gather).

        After an RL update (``policy_update``) with a streaming scheduler, the update is queued
        behind the requests each inference worker already has and the controller does not wait for
        it: those requests finish with the weights they were started with (their version), later
        ones use the new weights."""
        self.residency.use("actor_train", "actor_infer")
        if self.weight_sync == "collective":
            loads = self.actor.call("send_weights", self.bucket_bytes) + self.infer.call("receive_weights", self.weight_meta)
        else:
            buckets = self.actor.call("weight_bucket_list", self.bucket_bytes)
            loads = buckets[1:] + self.infer.call("load_weight_buckets", buckets[0])
        if not (self.streaming and policy_update):
            self.executor.get(loads)
            return
        self.executor.get(self._pending_loads)  # the previous update is long done; surfaces its errors
        self._pending_loads = loads
        self.scheduler.weights_updated()

    def _log_probs(self, group, batch: Batch, distribution: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token log-probs ``[B, R]`` of the responses under ``group``'s model, and with
        ``distribution`` the full log-distributions ``[B, R, V]`` from the same forward pass."""
        self.residency.use(group.role)
        temperature = self.config.rollout.temperature
        parts = self.executor.get(group.map("compute_log_probs", batch.chunk(len(group)),
                                            temperature=temperature, distribution=distribution))
        width = batch["responses"].shape[1]
        pad = (lambda p: (0, 0, 0, width - p.shape[1])) if distribution else (lambda p: (0, width - p.shape[1]))
        out = torch.cat([torch.nn.functional.pad(p, pad(p)) for p in parts])
        if not distribution:
            return out, None
        return out.gather(-1, batch["responses"][..., None]).squeeze(-1), out

    def _set_threads(self, rl: bool) -> None:
        """Roles with their own ``torch_threads`` use it during RL steps, when roles may run at
        once (an async trainer beside generation), and the run's count otherwise, when one role
        works alone (warm-up, evaluation) and may take every core."""
        roles = self.config.roles
        futures = []
        for name, group in self.groups.items():
            threads = getattr(getattr(roles, name, None), "torch_threads", None)
            if threads is not None:
                futures += group.call("set_threads", threads if rl else self.config.torch_threads)
        self.executor.get(futures)

    def _streamed_reference(self):
        """The reference group, when a streaming scheduler may compute its log-probs as groups
        complete: it has devices of its own (nothing to offload for it) and token log-probs are enough."""
        if self.reference is None or self.residency.colocation.get("reference") or any(self._kl_needs_distribution()):
            return None
        return self.reference

    def _kl_needs_distribution(self) -> tuple[bool, bool]:
        """(loss term, reward penalty) use a KL estimator that takes full distributions."""
        algo = self.config.algorithm
        penalty = bool(algo.kl_penalty.coef) and kl_takes_distribution(algo.kl_penalty.estimator, self.plugins)
        return needs_distribution(algo, self.plugins), penalty

    def collect(self) -> tuple[Batch, dict[str, float]]:
        """One step's scored groups, after dynamic sampling when it is configured."""
        self.residency.use("actor_infer")
        if self.streaming:
            batch, metrics = self.scheduler.next_batch()
            metrics.update(reward_stats(batch["scores"]))
            if self.multi_domain:
                metrics.update(domain_metrics(batch))
            return batch, metrics
        cfg = self.config
        want = cfg.rollout.prompts_per_step
        ds = cfg.algorithm.dynamic_sampling
        kept: list[Batch] = []
        n_kept = filtered = rounds = 0
        all_scores, rounds_seen = [], []
        batch = None
        timings: dict[str, float] = {}
        while n_kept < want and rounds < ds.max_rounds:
            rows = self.stream.next(want)
            batch = self.scheduler.collect(rows, num_return_sequences=cfg.rollout.num_return_sequences,
                                           temperature=cfg.rollout.temperature)
            for k, v in self.scheduler.last_metrics.items():
                timings[k] = timings.get(k, 0.0) + v
            # Group ids unique across rounds, so groups from different rounds never mix.
            batch.update(group_index=batch["group_index"] + rounds * want)
            all_scores.append(batch["scores"])
            rounds_seen.append(batch)
            rounds += 1
            keep = keep_groups(batch["scores"], batch["group_index"], ds)
            groups = batch["group_index"][keep].unique()
            filtered += want - len(groups)
            groups = groups[: want - n_kept]
            if len(groups):
                kept.append(batch.select(torch.isin(batch["group_index"], groups)))
                n_kept += len(groups)
        metrics = {**reward_stats(torch.cat(all_scores)), **timings}
        if ds.filter != "none":
            metrics.update({"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/filtered_groups": float(filtered),
                            "dynamic_sampling/kept_groups": float(n_kept)})
        if self.multi_domain:
            metrics.update(domain_metrics(Batch.concat(rounds_seen)))
        if not kept:
            # Nothing passed the filter within max_rounds: train on the last round as it is (for
            # GRPO-style estimators its advantages are zero, so the update is a no-op) and say so.
            metrics["dynamic_sampling/fallback"] = 1.0
            return batch, metrics
        return Batch.concat(kept), metrics

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy with greedy decoding (mean verifiable reward, per domain too)."""
        if not self.eval_rows:
            return {}
        self.residency.use("actor_infer")
        self.phase = "held-out evaluation"
        batch = self.scheduler.collect(self.eval_rows, num_return_sequences=1, temperature=0.0)
        metrics = {"eval/accuracy": float(batch["scores"].mean())}
        # The evaluation's own reward failures, so that they are not counted in the next RL step.
        metrics.update({f"eval/{k}": v for k, v in self.reward.pop_failures().items() if v})
        domains = rows_by_domain(batch)
        if len(domains) > 1:
            metrics.update({f"eval/accuracy/{d}": float(batch["scores"][idx].mean()) for d, idx in domains.items()})
        return metrics

    def warmup(self) -> dict[str, float]:
        """Supervised steps on the demonstrations (imitation before RL)."""
        wcfg = self.config.warmup
        rows = [r for r in self.train_rows if r.get("demonstration") is not None]
        if not rows:
            raise ConfigError("warmup.steps > 0 but no training row has a 'demonstration'; set warmup.steps=0")
        stream = PromptStream(rows, self.config.seed + SEED_OFFSETS['warmup_data'])
        eos = self.tokenizer.eos_token
        self.residency.use("actor_train")
        progress, task = _progress(wcfg.steps, "warm-up (supervised)")
        loss = float("nan")
        with progress:
            for step in range(1, wcfg.steps + 1):
                self.phase = f"warm-up step {step} of {wcfg.steps}"
                chunk = stream.next(wcfg.batch_size)
                prompt_ids, prompt_mask = tokenize_prompts(self.tokenizer, [r["prompt"] for r in chunk])
                resp = self.tokenizer([r["demonstration"] + eos for r in chunk], return_tensors="pt",
                                      padding=True, add_special_tokens=False, padding_side="right")
                batch = Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                               "responses": resp["input_ids"], "response_mask": resp["attention_mask"]})
                loss = self.executor.get(self.actor.map("sft_step", batch.chunk(len(self.actor)),
                                                        lr=wcfg.lr))[0]["warmup/loss"]
                progress.update(task, advance=1, info=f"loss {loss:.3f}")
        self.sync_weights()
        return {"warmup/loss": loss}

    def rl_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        batch, metrics = self.collect()
        t_rollout = time.perf_counter() - t0
        dist_loss, dist_penalty = self._kl_needs_distribution()
        if self.reference is not None and "ref_log_probs" not in batch:  # unless streamed with the rollout
            ref, ref_dist = self._log_probs(self.reference, batch, distribution=dist_loss or dist_penalty)
            batch.update(ref_log_probs=ref)
            if ref_dist is not None:
                batch.update(ref_log_dist=ref_dist)
        t_old = time.perf_counter()
        if not reuses_update_log_probs(self.config.algorithm, len(batch), self.plugins):
            old, old_dist = self._log_probs(self.actor, batch, distribution=dist_penalty)
            batch.update(old_log_probs=old)
            if old_dist is not None:
                batch.update(old_log_dist=old_dist)
        t_old = time.perf_counter() - t_old
        if self.critic is not None:
            self.residency.use("critic")
            batch.update(values=torch.cat(self.executor.get(self.critic.map("compute_values", batch.chunk(len(self.critic))))))
        metrics.update(self.shaper.shape(batch))
        metrics.update(self.reward.pop_failures())
        batch.tensors.pop("old_log_dist", None)
        if not dist_loss:
            batch.tensors.pop("ref_log_dist", None)
        t1 = time.perf_counter()
        self.residency.use(*self._trained_roles())
        pending_critic = self._train(self.critic, batch) if self.critic is not None else None
        pending_actor = self._train(self.actor, batch)
        if self.streaming:  # generation and scoring go on while the policy trains
            metrics.update(self.scheduler.wait_for(pending_actor[0]))
            self.executor.get(pending_actor[1:])
        else:
            metrics.update(self.executor.get(pending_actor)[0])
        if pending_critic is not None:
            metrics.update(self.executor.get(pending_critic)[0])
        t_train = time.perf_counter() - t1
        t2 = time.perf_counter()
        self.sync_weights(policy_update=True)
        lengths = batch["response_mask"].sum(-1).float()
        metrics.update({
            "response_length/mean": float(lengths.mean()),
            "response_length/clip_ratio": float(batch["truncated"].float().mean()) if "truncated" in batch else 0.0,
            "time/rollout_s": t_rollout,
            "time/train_s": t_train,
            "time/weight_sync_s": time.perf_counter() - t2,
            "time/step_s": time.perf_counter() - t0,
            **self.residency.metrics(),
        })
        # Idle time of each role in this step: the trainer works on the old log-probs and the
        # update; generation, outside a streaming scheduler, only during the rollout.
        metrics["time/idle/actor_train_s"] = max(0.0, metrics["time/step_s"] - t_train - t_old)
        if not self.streaming and "time/generate_s" in metrics:
            metrics["time/idle/actor_infer_s"] = max(0.0, metrics["time/step_s"] - metrics["time/generate_s"])
        return metrics

    def _train(self, group, batch: Batch) -> list:
        """Start ``train_step`` on every worker of a trained role, each with its data-parallel share
        (rank metrics are already reduced over ranks; rank 0's are the batch's)."""
        world = len(group)
        if len(batch) % world:
            raise RollError(f"{group.role}: a batch of {len(batch)} samples does not split over {world} "
                            f"data-parallel workers")
        return group.map("train_step", dp_shards(batch, world, self.config.algorithm.ppo_mini_batch_size))

    # ------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        def write(tmp: Path) -> None:
            self.residency.use(*self._trained_roles())
            self.executor.get(self.actor.call("save_checkpoint", str(tmp / "actor_train")))
            if self.critic is not None:
                self.executor.get(self.critic.call("save_checkpoint", str(tmp / "critic")))
            rng = self.executor.get(self.infer.call("rng_state"))
            torch.save({"actor_infer": rng}, tmp / "infer_rng.pt")

        state = {"data": self.stream.state(), "before_rl": self.before_rl, "seed": self.config.seed,
                 "shaping": self.shaper.state_dict(), "config": self.config.model_dump(mode="json")}
        return self.checkpoints.save(step, write, state)

    def restore(self, path: Path) -> int:
        state = self.checkpoints.load_state(path)
        self.executor.get(self.actor.call("load_checkpoint", str(path / "actor_train")))
        rng = torch.load(path / "infer_rng.pt", weights_only=False)["actor_infer"]
        if len(rng) != len(self.infer):
            raise ConfigError(f"checkpoint {path} has {len(rng)} actor_infer workers, config has {len(self.infer)}")
        self.executor.get([self.executor.invoke(h, "set_rng_state", (s,), {})
                           for h, s in zip(self.infer.handles, rng)])
        self.stream.load_state(state["data"])
        self.before_rl = state["before_rl"]
        if "shaping" in state:
            self.shaper.load_state_dict(state["shaping"])
        self.sync_weights()
        return int(state["step"])

    def resume_hint(self) -> str:
        latest = self.checkpoints.latest()
        return f"its last checkpoint, {latest}" if latest else "the start (no checkpoint yet)"

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------
    def run(self) -> dict:
        from transformers import AutoTokenizer

        cfg = self.config
        latest = self.checkpoints.latest() if cfg.trainer.resume == "auto" else None
        if latest is not None:  # before anything is written or started
            check_resume(self.checkpoints.load_state(latest).get("config"), cfg.model_dump(mode="json"), latest)
        (self.run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
        model_path = self._model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.train_rows, self.eval_rows = self._load_data()
        self._check_domains()
        domains = {row.get("domain", "default") for row in self.train_rows}
        self.multi_domain = len(domains) > 1 or bool(cfg.roles.domain_rewards)
        self.scheduler_cls = self.plugins.schedulers.get(cfg.rollout.scheduler)
        self.streaming = bool(getattr(self.scheduler_cls, "streaming", False))
        self._place()
        trackers = self._make_trackers()
        restarts = 0
        try:
            while True:
                try:
                    summary = self._attempt(model_path, trackers, resume=restarts > 0 or cfg.trainer.resume == "auto")
                    break
                except WorkerLostError as exc:
                    latest = self.checkpoints.latest()
                    where = f"the last checkpoint, {latest}" if latest else "the start (no checkpoint yet)"
                    if restarts >= cfg.runtime.max_restarts:
                        raise WorkerLostError(f"{exc}. No restarts left (runtime.max_restarts={cfg.runtime.max_restarts}); "
                                              f"run the same command again to resume from {where}") from exc
                    restarts += 1
                    print(f"warning: {exc}. Restarting every worker from {where} "
                          f"(restart {restarts} of {cfg.runtime.max_restarts})", flush=True)
                    self.executor.kill_all()
        finally:
            for t in trackers:
                t.close()
        summary["restarts"] = restarts
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _attempt(self, model_path: str, trackers: list, resume: bool) -> dict:
        """Start every worker, resume from the latest checkpoint (or begin), and train to max_steps."""
        cfg = self.config
        if cfg.data.domain_interleave_probs:
            self.stream = DomainMixer(self.train_rows, cfg.data.domain_interleave_probs, cfg.seed)
        else:
            self.stream = PromptStream(self.train_rows, cfg.seed)
        self.shaper = RewardShaper(cfg.algorithm, self.plugins)
        self._spawn_workers(model_path)
        self.scheduler = self.scheduler_cls(cfg, self.executor, self.infer, self.reward, self.tokenizer)
        self._pending_loads: list = []
        if self.streaming:
            _warn_if_oversubscribed(cfg)
        self.before_rl: dict = {}
        start = 0
        latest = self.checkpoints.latest() if resume else None
        warm_dir = self.run_dir / "warm-model"
        if latest is not None:
            start = self.restore(latest)
            print(f"resumed from {latest} at step {start} (data position {self.stream.state()})", flush=True)
            self._spawn_policy_copies(str(warm_dir) if (warm_dir / "config.json").exists() else model_path)
            if self.critic is not None:
                self.executor.get(self.critic.call("load_checkpoint", str(latest / "critic")))
        else:
            first = {}
            if cfg.warmup.steps:
                first.update(self.warmup())
                self.executor.get(self.actor.call("save_checkpoint", str(warm_dir.with_name("warm-tmp"))))
                # The reference is the policy RL starts from: the warmed-up model.
                _replace_dir(warm_dir.with_name("warm-tmp") / "model", warm_dir)
                self.tokenizer.save_pretrained(warm_dir)
            self._spawn_policy_copies(str(warm_dir) if cfg.warmup.steps else model_path)
            self.before_rl = self.evaluate()
            first.update(self.before_rl)
            if self.before_rl:
                print(f"held-out accuracy before RL (greedy): {self.before_rl['eval/accuracy']:.1%}", flush=True)
            for t in trackers:
                t.log(first, 0)
            self.save(0)
        self._record_placement()
        if self.streaming:  # the reference exists only now (it starts from the warmed-up policy)
            self.scheduler.attach(self.stream, reference=self._streamed_reference())
        self._set_threads(rl=True)
        last_eval, last_eval_step = {}, None
        for step in range(start + 1, cfg.trainer.max_steps + 1):
            self.phase = f"RL step {step} of {cfg.trainer.max_steps}"
            metrics = self.rl_step()
            metrics["data/epoch"] = self.stream.epoch
            if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0:
                last_eval, last_eval_step = self.evaluate(), step
                metrics.update(last_eval)
            for t in trackers:
                t.log(metrics, step)
            if step == cfg.trainer.max_steps or (cfg.trainer.save_every and step % cfg.trainer.save_every == 0):
                self.save(step)
        if self.streaming:
            self.scheduler.drain()  # no request outlives the run
            self.executor.get(self._pending_loads)
        self._set_threads(rl=False)
        final_step = max(start, cfg.trainer.max_steps)
        after = last_eval if last_eval_step == final_step else self.evaluate()
        summary = {"steps": final_step, "before_rl": self.before_rl, "after_rl": after}
        if self.before_rl and after:
            b, a = self.before_rl["eval/accuracy"], after["eval/accuracy"]
            summary["accuracy_gain_pp"] = round(100 * (a - b), 2)
            print(f"held-out accuracy (greedy): before RL {b:.1%} -> after RL {a:.1%} "
                  f"({100 * (a - b):+.1f} pp) after {final_step} RL steps", flush=True)
        return summary


def _warn_if_oversubscribed(cfg) -> None:
    """Asynchronous training runs generation and training at once. On CPU workers with more intra-op
    threads than cores between them, both slow down (measured on 2 cores with 2 + 2 threads: a step
    4x slower with OpenMP's spinning waits, which the Ray executor now turns off for streaming
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


def _replace_dir(src: Path, dst: Path) -> None:
    import shutil

    if dst.exists():
        shutil.rmtree(dst)
    src.rename(dst)
    shutil.rmtree(src.parent, ignore_errors=True)
