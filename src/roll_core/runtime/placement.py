"""Device mapping: which devices each role's workers run on, checked before any worker starts.

A role's ``device_mapping`` lists *global* device indices. With ``G`` devices per node, device
``d`` is local GPU ``d % G`` of node ``d // G``; nodes are ranked by the placement groups the Ray
executor reserves (one per node, holding all its devices). Roles whose mappings overlap are
**colocated**: they time-share the devices, and :class:`Residency` offloads one role's model and
optimizer states before an overlapping role runs. Disjoint mappings run **disaggregated**.

Rules (each violation is a config error naming the key):

* a worker's devices are on one node, and no index is beyond the cluster;
* reward roles never overlap another role (they score while the policy generates, so they
  cannot be offloaded), and with a scheduler that overlaps training (``async``) actor_train and
  actor_infer are disjoint
  (generation runs while the policy trains);
* the ``local`` executor runs every role in one process: no device mappings, no data parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

from roll_core.errors import ConfigError, RegistryError

_TRAINED_KINDS = ("train", "critic")


def _overlap(a: list[int] | None, b: list[int] | None) -> list[int]:
    return sorted(set(a or ()) & set(b or ()))


def check_mappings(cfg) -> None:
    """Config-time checks (no cluster needed). Raises ``ValueError`` (reported by pydantic with the key)."""
    roles = cfg.placed_roles()
    mapped = {name: role.devices for name, role in roles.items() if role.devices is not None}
    if cfg.executor == "local":
        if mapped:
            raise ValueError(f"roles.{next(iter(mapped))}.device_mapping needs executor: ray (the local executor "
                             f"runs every role in the driver process)")
        for name in [n for n, r in roles.items() if r.kind in _TRAINED_KINDS]:
            if roles[name].num_workers > 1:
                raise ValueError(f"roles.{name}.num_workers > 1 (data-parallel training) needs executor: ray")
        threaded = [name for name, role in roles.items() if getattr(role, "torch_threads", None) is not None]
        if threaded:
            raise ValueError(f"roles.{threaded[0]}.torch_threads needs executor: ray (the local executor runs every "
                             f"role in one process, which has one thread count: use torch_threads)")
        if cfg.runtime.weight_sync == "collective":
            raise ValueError("runtime.weight_sync: collective needs executor: ray (the local executor runs every "
                             "worker in one process); use object_store or auto")
    if cfg.runtime.weight_sync == "in_process" and (overlap := generates_while_training(cfg)):
        raise ValueError(f"runtime.weight_sync: in_process hands the engine the trainer's weights in its process, "
                         f"but {overlap}; use object_store or auto")
    samples = cfg.rollout.prompts_per_step * cfg.rollout.num_return_sequences
    for name in [n for n, r in roles.items() if r.kind in _TRAINED_KINDS]:
        if roles[name].num_workers == 1:
            continue
        world = roles[name].num_workers
        for what, size in (("the samples per step", samples), ("algorithm.ppo_mini_batch_size", cfg.algorithm.ppo_mini_batch_size)):
            if size is not None and size % world:
                raise ValueError(f"roles.{name}.num_workers ({world}) must divide {what} ({size}): every "
                                 f"data-parallel worker takes an equal share of each mini-batch")
    names = list(mapped)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            shared = _overlap(mapped[a], mapped[b])
            if not shared:
                continue
            reward = next((n for n in (a, b) if roles[n].kind == "reward"), None)
            if reward is not None:
                raise ValueError(f"roles.{reward}.device_mapping overlaps roles.{a if reward == b else b} on devices "
                                 f"{shared}: reward workers cannot be offloaded, give them their own devices")
            if {a, b} == {"actor_train", "actor_infer"} and (overlap := generates_while_training(cfg)):
                raise ValueError(f"roles.actor_train and roles.actor_infer share devices {shared}, but {overlap}: "
                                 f"give them disjoint device_mapping")
    if cfg.executor == "ray" and cfg.ray.hybrid_engine is True and (blocker := hybrid_engine_blocker(cfg)):
        raise ValueError(f"ray.hybrid_engine: true, but {blocker}; use auto (on wherever it can be) or false")
    if cfg.executor == "ray" and cfg.ray.colocate_controller is True and (blocker := controller_blocker(cfg)):
        raise ValueError(f"ray.colocate_controller: true, but {blocker}; use auto (on wherever it can be) or false")
    per_node, nodes = cfg.runtime.num_gpus_per_node, cfg.runtime.num_nodes
    if per_node is not None:
        problems = cluster_problems(cfg, per_node, nodes)
        if problems:
            raise ValueError(problems[0])


def generates_while_training(cfg) -> str | None:
    """Why actor_infer may generate while actor_train updates the policy (None: every rollout waits
    for the update), as the run's pipeline says (``Pipeline.generates_while_training``: the rollout
    scheduler; the agentic pipeline's ``agentic.rollout``)."""
    from roll_core.pipelines import pipeline_class
    from roll_core.plugins import get_plugins

    plugins = get_plugins()
    return pipeline_class(cfg, plugins).generates_while_training(cfg, plugins)


def hybrid_engine_blocker(cfg) -> str | None:
    """Why actor_infer's worker cannot live in actor_train's worker process on Ray (None: it can).

    One process runs one call at a time and has one thread count, and the trainer's process group
    is its own; so: a rollout that waits for the update (``rollout.scheduler``, and for the agentic
    pipeline ``agentic.rollout``), CPU workers (no ``device_mapping``), one worker of each role, the
    same RL thread count, and an engine that serves one request at a time."""
    from roll_core.plugins import get_plugins

    train, infer = cfg.roles.actor_train, cfg.roles.actor_infer
    if overlap := generates_while_training(cfg):
        return overlap
    if train.device_mapping is not None or infer.device_mapping is not None:
        return "it runs CPU workers only (actor_train and actor_infer without a device_mapping)"
    if train.num_workers != 1 or infer.num_workers != 1:
        return "it needs roles.actor_train.num_workers and roles.actor_infer.num_workers of 1"
    if cfg.rl_threads("actor_train") != cfg.rl_threads("actor_infer"):
        return "actor_train and actor_infer have different torch_threads (a process has one thread count)"
    try:
        engine = get_plugins().infer_strategies.get(infer.strategy)
    except RegistryError:  # an unknown name is reported by the registry-name check
        return f"actor_infer's strategy '{infer.strategy}' is not registered"
    if getattr(engine, "concurrent_requests", False) or getattr(engine, "sharded", False):
        return f"actor_infer's strategy '{infer.strategy}' is an engine of its own (concurrent or sharded)"
    return None


def hybrid_engine(cfg) -> bool:
    """Whether actor_infer's worker is built inside actor_train's (``ray.hybrid_engine``)."""
    return cfg.executor == "ray" and cfg.ray.hybrid_engine is not False and hybrid_engine_blocker(cfg) is None


def controller_blocker(cfg) -> str | None:
    """Why the pipeline's controller cannot run inside the run's one worker process on Ray (None:
    it can, ``ray.colocate_controller``). It can when every role the run starts lives in one
    process: actor_train alone (one CPU worker), actor_infer inside it (the hybrid engine, its
    weights handed over in memory), the rewards scored in the controller (``placement``), and no
    reference, critic or environment workers of their own."""
    from roll_core.pipelines import pipeline_class
    from roll_core.pipelines.runtime import scores_in_driver
    from roll_core.plugins import get_plugins

    roles, plugins = cfg.roles, get_plugins()
    pipeline = pipeline_class(cfg, plugins)
    if pipeline.environments(cfg):
        return f"the {cfg.pipeline} pipeline's environment workers run in processes of their own"
    train = roles.actor_train
    if train.device_mapping is not None or train.num_workers != 1:
        return "it needs one CPU worker of actor_train (no device_mapping, num_workers 1)"
    if cfg.ray.hybrid_engine is False:
        return "actor_infer runs in a process of its own (ray.hybrid_engine: false)"
    if blocker := hybrid_engine_blocker(cfg):
        return f"actor_infer runs in a process of its own: the hybrid engine is off, as {blocker}"
    if cfg.runtime.weight_sync not in ("auto", "in_process"):
        return f"runtime.weight_sync '{cfg.runtime.weight_sync}' moves the weights between processes"
    if roles.critic is not None:
        return "roles.critic runs on workers of its own"
    if own := roles.own():
        return f"roles.{next(iter(own))} runs on workers of its own"
    if roles.reference is not None and not cfg.reference_on_actor() and pipeline.starts_reference(cfg, plugins):
        return "roles.reference runs on workers of its own"
    for key, (spec, entries) in roles.reward_roles().items():
        try:
            if not scores_in_driver(spec, [r.name for r in entries], plugins.rewards):
                return f"{key} scores on workers of its own (its placement)"
        except RegistryError:  # an unknown name is reported by the registry-name check
            return f"{key} names a reward that is not registered"
    return None


def controller_in_worker(cfg) -> bool:
    """Whether ``roll run`` runs the pipeline inside its one Ray worker (``ray.colocate_controller``,
    :mod:`roll_core.runtime.controller`)."""
    return cfg.executor == "ray" and cfg.ray.colocate_controller is not False and controller_blocker(cfg) is None


def cluster_problems(cfg, per_node: int, nodes: int | None) -> list[str]:
    """Every worker's devices on one node, none beyond ``nodes * per_node``."""
    total = None if nodes is None else nodes * per_node
    out = []
    for name, role in cfg.placed_roles().items():
        for devices in role.worker_devices() or ():
            if total is not None and max(devices) >= total:
                out.append(f"key 'roles.{name}.device_mapping': device {max(devices)} is beyond the cluster's "
                           f"{total} devices ({nodes} node(s) x {per_node}); valid indices are 0..{total - 1}")
            elif len({d // per_node for d in devices}) > 1:
                out.append(f"key 'roles.{name}.device_mapping': a worker's devices {devices} span nodes "
                           f"({per_node} devices per node); a worker must sit on one node")
    return out


def check_cluster(cfg, gpus_by_node: list[int]) -> int:
    """Check the mappings against a running cluster (devices of each node that has any); returns
    the devices per node used to number them. Raises :class:`ConfigError` before any worker starts."""
    if not any(role.devices is not None for role in cfg.placed_roles().values()):
        return 0
    gpu_nodes = [g for g in gpus_by_node if g > 0]
    if not gpu_nodes:
        raise ConfigError("device_mapping is set but the Ray cluster has no GPU resources; drop the mappings "
                          "to run every role on CPU, or join a cluster with GPUs (ray.address)")
    per_node = cfg.runtime.num_gpus_per_node or min(gpu_nodes)
    usable = sum(1 for g in gpu_nodes if g >= per_node)
    problems = cluster_problems(cfg, per_node, usable)
    if problems:
        raise ConfigError(problems[0])
    return per_node


@dataclass(frozen=True)
class WorkerSlot:
    """Where one worker runs: node rank and the local device ids on that node."""

    node: int
    local_devices: tuple[int, ...]


def worker_slots(role, per_node: int) -> list[WorkerSlot] | None:
    spec = role.worker_devices()
    if spec is None:
        return None
    return [WorkerSlot(d[0] // per_node, tuple(x % per_node for x in d)) for d in spec]


def nodes_needed(cfg, per_node: int) -> int:
    mapped = [d for role in cfg.placed_roles().values() for d in (role.devices or ())]
    return (max(mapped) // per_node + 1) if mapped else 0


def colocated(cfg) -> dict[str, set[str]]:
    """For each model role, the other model roles that share a device with it."""
    roles = {n: r.devices for n, r in cfg.placed_roles().items() if r.kind != "reward" and r.devices is not None}
    return {a: {b for b in roles if b != a and _overlap(roles[a], roles[b])} for a in roles}


class Residency:
    """Time-sharing of colocated roles: before a role runs, every *other* role that shares a device
    with it and is on the device is offloaded (``offload`` on its workers), and the role itself is
    reloaded if it was offloaded. Disaggregated layouts never offload anything."""

    def __init__(self, executor, groups: dict, colocation: dict[str, set[str]]):
        self.executor, self.groups, self.colocation = executor, groups, colocation
        self.offloaded: set[str] = set()
        self.counts = {"offloads": 0, "reloads": 0}
        self.seconds = 0.0

    def use(self, *roles: str) -> None:
        import time

        t0 = time.perf_counter()
        evict = {o for r in roles for o in self.colocation.get(r, ())} - set(roles) - self.offloaded
        futures = [f for o in sorted(evict) if o in self.groups for f in self.groups[o].call("offload")]
        back = [r for r in roles if r in self.offloaded]
        futures += [f for r in back for f in self.groups[r].call("reload")]
        if futures:
            self.executor.get(futures)
        self.offloaded = (self.offloaded | evict) - set(back)
        self.counts["offloads"] += len(evict)
        self.counts["reloads"] += len(back)
        self.seconds += time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        if not self.colocation or not any(self.colocation.values()):
            return {}
        return {"colocation/offloads": float(self.counts["offloads"]), "colocation/reloads": float(self.counts["reloads"]),
                "time/offload_s": self.seconds}
