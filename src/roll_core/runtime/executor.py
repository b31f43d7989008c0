"""Executors: where role workers live and how the driver calls them.

* ``local``: every worker is an object in the driver process. For debuggers and machines without Ray.
* ``ray``: every worker is a Ray actor. ``roll run`` starts a local Ray cluster when
  ``ray.address`` is unset and joins the given cluster otherwise.

Both expose the same API: ``spawn`` a :class:`WorkerGroup`, call methods on it (getting futures),
and ``get`` the results, so pipelines are written once.

The hybrid engine (``ray.hybrid_engine``): a worker may be built inside another role's worker
process (:meth:`Executor.spawn_hosted`), as ROLL and verl run the trainer and its rollout engine
in one process. Its handle is a :class:`Hosted`; calls to it travel through the host and run in
order with the host's own. On 2 CPU cores the quickstart's update and generate calls, replayed
alternately, run 8% and 24% faster in one process than in two that take turns
(``benchmarks/bench_hybrid.py``), and the weight update never leaves the process.

Calls sent as one task (:meth:`Executor.one_task_per_worker`): the calls a block makes go to
each worker process as a single Ray task that runs them in order. The RLVR step sends the update,
the weight hand-over and the next step's generation to the hybrid engine's worker this way: one
submission instead of three, and the driver sleeps until the generation is done instead of waking
for the update's metrics on the cores that generate (on 2 cores, 2% less time per step, measured
inside single runs). Their results arrive together, so the worker times each call
(:meth:`Executor.call_seconds`) for the step's metrics. (Ray's Compiled Graphs would halve the task's
dispatch and return, but their channel readers spin while they wait: on 2 cores the worker's
work took 1.44x as long, ``benchmarks/bench_compiled_graph.py``.)

Device placement (Ray): :meth:`RayExecutor.reserve_devices` holds one placement group per node,
each a single bundle with all of the node's GPUs; a worker with a device mapping is scheduled into
its node's group with a token GPU share, so colocated roles can share GPUs, and pins its own
devices (``CUDA_VISIBLE_DEVICES``, see :mod:`roll_core.runtime.placement`). Workers without a
mapping need no resources at all and run on CPU wherever Ray puts them.

A worker that dies or does not answer within ``runtime.worker_timeout_s`` raises
:class:`~roll_core.errors.WorkerLostError` from ``get``; the pipeline decides whether to restart.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator, NoReturn

from roll_core.errors import RollError, WorkerLostError

# Arguments and results up to this size travel inside Ray's task messages; larger ones go through
# its shared-memory object store. Ray's default cut is 100 KiB; a quickstart update's batch (about
# 113 KB) crossed it every step. benchmarks/bench_ray_inline.py, on 2 cores: a batch's round trip
# through the store took a near-constant 3.5-4 ms, inline 1.65 ms at 108 KB and 2.68 ms at 431 KB;
# the two meet between 512 KiB and 1 MiB. Set only on a cluster roll starts itself.
RAY_INLINE_BYTES = 512 * 1024


@dataclass(frozen=True)
class Hosted:
    """The handle of a worker of ``role`` that lives in the process of the worker ``host``."""

    host: Any
    role: str


class _Deferred:
    """The future of a call made inside :meth:`RayExecutor.one_task_per_worker`: its Ray future
    (``ref``) once the block has sent the call."""

    __slots__ = ("ref", "seconds")

    def __init__(self):
        self.ref = None
        self.seconds = None  # (future of the task's list of seconds per call, this call's index)


class WorkerGroup:
    """The workers of one role, called in one of three ways: :meth:`call` (the same arguments to
    every worker), :meth:`map` (one part per worker) and :meth:`data_parallel` (each data-parallel
    rank its shard of every mini-batch; workers that share a rank under tensor or pipeline
    parallelism get the same shard)."""

    def __init__(self, role: str, handles: list, executor: "Executor", spawned_with: tuple = ()):
        self.role, self.handles, self.executor = role, handles, executor
        self.spawned_with = spawned_with  # (cls, args_per_worker, slots, concurrency), for replace()
        # each worker's data-parallel rank, from its strategy's layout (set up by the runtime);
        # until then every worker is a replica of its own
        self.dp_ranks: list[int] = list(range(len(handles)))
        self.renamed: dict[str, str] = {}  # method -> the method the workers run (see as_role)
        self.serves: str | None = None  # the role whose workers these are, when this group is its view

    def as_role(self, role: str, **renamed: str) -> "WorkerGroup":
        """These workers serving another role: ``renamed`` maps the role's method names to theirs
        (a LoRA run's reference is actor_train with ``compute_log_probs="base_log_probs"``)."""
        view = WorkerGroup(role, self.handles, self.executor, self.spawned_with)
        view.dp_ranks, view.renamed, view.serves = self.dp_ranks, renamed, self.role
        return view

    @property
    def resident_role(self) -> str:
        """The role whose workers these are (itself, unless this group is another's view)."""
        return self.serves or self.role

    def _invoke(self, handle, method: str, args: tuple, kwargs: dict):
        method = self.renamed.get(method, method)
        cls = self.spawned_with[0] if self.spawned_with else None
        if cls is not None and not callable(getattr(cls, method, None)):  # before Ray turns it into a bare AttributeError
            offered = sorted(m for m in dir(cls) if not m.startswith("_") and callable(getattr(cls, m)))
            raise RollError(f"{self.role}: its workers ({cls.__name__}) have no method '{method}'; they offer "
                            f"{', '.join(offered)}")
        return self.executor.invoke(handle, method, args, kwargs)

    def __len__(self) -> int:
        return len(self.handles)

    def call(self, method: str, /, *args, **kwargs) -> list:
        """Call ``method`` with the same arguments on every worker; returns futures."""
        return [self._invoke(h, method, args, kwargs) for h in self.handles]

    def map(self, method: str, parts: list, /, **kwargs) -> list:
        """Call ``method(parts[i], **kwargs)`` on worker ``i``; returns futures."""
        if len(parts) != len(self.handles):
            raise ValueError(f"{self.role}: {len(parts)} parts for {len(self.handles)} workers")
        return [self._invoke(h, method, (p,), kwargs) for h, p in zip(self.handles, parts)]

    @property
    def dp_size(self) -> int:
        return max(self.dp_ranks) + 1

    def per_replica(self, method: str, batch, /, **kwargs) -> list:
        """Call ``method(chunk, **kwargs)`` on every worker, where data-parallel rank ``r`` gets the
        ``r``-th of ``dp_size`` contiguous chunks of ``batch`` (the workers of one rank, its tensor-
        and pipeline-parallel peers, all get the same chunk). Returns one future per rank, in rank
        order (its first worker's), so the results concatenate back to the batch's order."""
        chunks = batch.chunk(self.dp_size)
        firsts: dict[int, object] = {}
        for handle, rank in zip(self.handles, self.dp_ranks):
            future = self._invoke(handle, method, (chunks[rank],), kwargs)
            firsts.setdefault(rank, future)
        return [firsts[r] for r in range(self.dp_size)]

    def on_replica(self, rank: int, method: str, /, *args, **kwargs):
        """Call ``method`` on the workers of data-parallel replica ``rank`` (one worker, or the
        tensor- and pipeline-parallel peers that hold one model between them); returns the future
        of its first worker, which carries the replica's result."""
        futures = [self._invoke(h, method, args, kwargs) for h, r in zip(self.handles, self.dp_ranks)
                   if r == rank]
        return futures[0]

    def data_parallel(self, method: str, batch, /, *, mini_batch_size: int | None = None, **kwargs) -> list:
        """Call ``method(shard, **kwargs)`` on every worker: data-parallel rank ``r`` gets the ``r``-th
        of ``dp_size`` equal parts of every mini-batch of ``mini_batch_size`` rows
        (:func:`roll_core.data.dp_shards`), so its ``k``-th local mini-batch is its part of the global one."""
        from roll_core.data import dp_shards

        if len(batch) % self.dp_size:
            raise RollError(f"{self.role}: a batch of {len(batch)} samples does not split over {self.dp_size} "
                            f"data-parallel ranks")
        shards = dp_shards(batch, self.dp_size, mini_batch_size)
        return [self._invoke(h, method, (shards[r],), kwargs) for h, r in zip(self.handles, self.dp_ranks)]


class Executor(ABC):
    name: str

    @abstractmethod
    def spawn(self, role: str, cls: type, args_per_worker: list[tuple], slots: list | None = None,
              concurrency: int = 1, cpus: float = 0.0) -> WorkerGroup:
        """One worker per entry of ``args_per_worker``; ``slots`` (:class:`~roll_core.runtime.placement.WorkerSlot`)
        say on which node each one runs; ``concurrency`` calls may run at once on a worker; ``cpus``
        CPUs are reserved for each (Ray spreads workers that reserve CPUs over the cluster's nodes)."""

    def spawn_hosted(self, role: str, cls: type, args_per_worker: list[tuple], host_in: WorkerGroup) -> WorkerGroup:
        """Worker ``i`` built inside the process of ``host_in``'s worker ``i`` (the hybrid engine)."""
        if len(args_per_worker) != len(host_in):
            raise RollError(f"{role}: {len(args_per_worker)} workers cannot live in {host_in.role}'s "
                            f"{len(host_in)} worker processes")
        self.get([self.invoke(h, "host", (role, cls, args), {}) for h, args in zip(host_in.handles, args_per_worker)])
        return WorkerGroup(role, [Hosted(h, role) for h in host_in.handles], self, (cls, args_per_worker, None, 1, 0.0))

    @abstractmethod
    def invoke(self, handle, method: str, args: tuple, kwargs: dict) -> Any: ...

    @abstractmethod
    def get(self, futures): ...

    def wait(self, futures: list) -> list[int]:
        """Positions in ``futures`` of those that have finished (at least one; blocks until then)."""
        return list(range(len(futures)))

    @contextlib.contextmanager
    def one_task_per_worker(self) -> Iterator[None]:
        """Calls made inside the block go to each worker process as one task, sent when the block
        ends, and run there in the order they were made; the task's results all arrive when its last
        call is done. Futures of calls made inside are read after the block. Local calls have already
        run: nothing to do."""
        yield

    def call_seconds(self, future) -> float | None:
        """Seconds the worker spent on a finished call that was sent with others as one task (its
        result arrives only with the last call's, so the driver cannot time it); None for any other
        call, which the driver times itself."""
        return None

    def replace(self, group: WorkerGroup, index: int):
        """Put a fresh worker, built with the same arguments, in place of ``group.handles[index]``
        and return the old handle. The old worker keeps running, so calls already queued on it still
        complete; the caller stops it (:meth:`stop`) once they have."""
        cls, args_per_worker, slots, concurrency, cpus = group.spawned_with
        old = group.handles[index]
        fresh = self.spawn(group.role, cls, [args_per_worker[index]], slots and [slots[index]], concurrency, cpus)
        group.handles[index] = fresh.handles[0]
        return old

    def stop(self, handle) -> None:
        """Stop one worker: its process ends (Ray: at once, as for a hung worker being replaced), or
        its ``close`` releases what it holds (local)."""

    def cancel(self, futures: list) -> None:
        """Abort calls whose results are no longer wanted: a queued call never runs, a running one
        sees :func:`roll_core.strategy.request_cancelled`. Never ``get`` a cancelled future; ``wait``
        for it to learn that its worker is free. (Local calls have already run: nothing to do.)"""

    def gpus_by_node(self) -> list[int]:
        """GPUs of every node of the cluster (for checking device mappings)."""
        return []

    def reserve_devices(self, num_nodes: int, per_node: int) -> list[str]:
        """Hold ``per_node`` devices on each of ``num_nodes`` nodes; returns their node ids."""
        raise RollError(f"executor '{self.name}' cannot place workers on devices; use executor: ray")

    def kill_all(self) -> None:
        """Stop every worker spawned so far (before a restart, and at :meth:`shutdown`), each
        after its ``close``."""

    def shutdown(self, close_within: float | None = None) -> None:
        """Stop every worker, each after its ``close``, and release the executor's resources.
        ``close_within``: seconds to wait for workers in other processes to close (None: the
        executor's default); a run interrupted by Ctrl-C does not wait for a busy one."""


class LocalExecutor(Executor):
    """Runs every worker in the driver process; futures are the results themselves. No process
    ends with a worker here, so stopping one calls its ``close`` (an engine's threads and memory,
    :meth:`roll_core.strategy.Colocatable.close`), and :meth:`shutdown` stops them all: a driver
    that starts another run (a notebook, a test session) does not keep the last one's engines."""

    name = "local"

    def __init__(self) -> None:
        self._workers: list = []  # in the order spawned

    def spawn(self, role, cls, args_per_worker, slots=None, concurrency=1, cpus=0.0):
        workers = [cls(*args) for args in args_per_worker]
        self._workers.extend(workers)
        return WorkerGroup(role, workers, self, (cls, args_per_worker, slots, concurrency, cpus))

    def stop(self, handle) -> None:
        if isinstance(handle, Hosted):  # closed with its host
            return
        self._workers = [w for w in self._workers if w is not handle]
        close = getattr(handle, "close", None)  # roll's workers have one; any class may be spawned
        if close is not None:
            close()

    def kill_all(self) -> None:
        """Close every worker, the last spawned first; one whose ``close`` fails is reported and the
        others are still closed (this runs on the way out of a failed run too)."""
        for worker in reversed(list(self._workers)):
            try:
                self.stop(worker)
            except Exception as exc:  # noqa: BLE001 - the run's own error, if any, matters more
                warnings.warn(f"closing a {type(worker).__name__} failed: {type(exc).__name__}: {exc}",
                              RuntimeWarning, stacklevel=2)

    def shutdown(self, close_within: float | None = None) -> None:
        self.kill_all()  # closes run here, in this process: nothing to wait for

    def invoke(self, handle, method, args, kwargs):
        if isinstance(handle, Hosted):
            return handle.host.call_hosted(handle.role, method, args, kwargs)
        return getattr(handle, method)(*args, **kwargs)

    def get(self, futures):
        return futures


def raise_roll_error(exc: BaseException) -> NoReturn:
    """Re-raise ``exc``, a failed Ray task, as what the worker raised when that was a
    :class:`RollError` (a config or data error the user fixes, whose message is the whole story),
    and as itself, with the worker's traceback, otherwise. Call it inside the ``except`` block."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, RollError):
        raise cause from None
    raise exc


class RayExecutor(Executor):
    """Workers are Ray actors. Worker exceptions surface in ``get`` with the worker's own message."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None, timeout_s: float | None = None,
                 worker_env: dict[str, str] | None = None, worker_niceness: int = 0):
        import ray

        self.ray = ray
        self.timeout_s = timeout_s
        self._actors: list = []
        self._node_groups: list = []
        self._owns_cluster = False
        self._batches: dict | None = None  # actor -> [(call, future)], inside one_task_per_worker
        if not ray.is_initialized():
            # Ray's own start-up warnings (token authentication, ...) only with ROLL_VERBOSE (roll run -v);
            # workers' errors still surface in full, raised by get()
            level = "warning" if os.environ.get("ROLL_VERBOSE") else "error"
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True,
                                      "configure_logging": True, "logging_level": level}
            if address:
                kwargs["address"] = address
            else:  # "local": a new cluster even when another one runs on this machine
                # roll runs actors only; the idle task workers Ray prestarts for the first driver (one per
                # CPU) would sit beside them, each waking ~140 times a second and holding ~100 MB
                kwargs.update(address="local", num_cpus=num_cpus or os.cpu_count(),
                              _system_config={"worker_niceness": worker_niceness,
                                              "prestart_worker_first_driver": False,
                                              "max_direct_call_object_size": RAY_INLINE_BYTES})
                self._owns_cluster = True
            # Workers must find the same packages and plugins as the driver, and keep its OpenMP and
            # Hugging Face settings (HF_HUB_DISABLE_PROGRESS_BARS: roll run hides the load/save bars).
            env = {k: v for k, v in os.environ.items()
                   if k.startswith(("ROLL_", "OMP_", "GOMP_", "KMP_", "HF_")) or k == "PYTHONPATH"}
            kwargs["runtime_env"] = {"env_vars": {**(worker_env or {}), **env}}
            ray.init(**kwargs)

    def spawn(self, role, cls, args_per_worker, slots=None, concurrency=1, cpus=0.0):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # CPU workers need no resources by default (num_cpus=0), so every role fits on a small machine.
        remote_cls = self.ray.remote(num_cpus=cpus)(cls)
        handles = []
        for i, args in enumerate(args_per_worker):
            options: dict[str, Any] = {"name": None, "max_concurrency": concurrency}
            if slots is not None:
                slot = slots[i]
                if slot.node >= len(self._node_groups):
                    raise RollError(f"{role}: worker {i} is mapped to node {slot.node}, but only "
                                    f"{len(self._node_groups)} node(s) are reserved")
                # A token share of one GPU: Ray keeps the worker on its node, and colocated workers
                # (several roles on the same devices) still fit; the worker pins its own devices.
                options.update(num_gpus=0.01, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._node_groups[slot.node], placement_group_bundle_index=0))
            handles.append(remote_cls.options(**options).remote(*args))
        self._actors += handles
        return WorkerGroup(role, handles, self, (cls, args_per_worker, slots, concurrency, cpus))

    def invoke(self, handle, method, args, kwargs):
        actor, role = (handle.host, handle.role) if isinstance(handle, Hosted) else (handle, None)
        if self._batches is not None:
            future = _Deferred()
            self._batches.setdefault(actor, []).append(((role, method, args, kwargs), future))
            return future
        return self._submit(actor, role, method, args, kwargs)

    @staticmethod
    def _submit(actor, role: str | None, method: str, args: tuple, kwargs: dict):
        """One call as its own task: to the actor's method, or through it to its hosted worker ``role``."""
        if role is not None:
            return actor.call_hosted.remote(role, method, args, kwargs)
        return getattr(actor, method).remote(*args, **kwargs)

    @contextlib.contextmanager
    def one_task_per_worker(self):
        """Each Ray task costs the driver a submission and the worker a receipt, on the cores its
        thread team computes on; a worker's calls of one step (update, weight hand-over, the next
        generation) sent as one task cost that once. A block that raises sends nothing."""
        if self._batches is not None:  # nested: the outermost block sends
            yield
            return
        self._batches = {}
        try:
            yield
            batches = self._batches
        finally:
            self._batches = None
        for actor, queued in batches.items():
            calls, futures = zip(*queued)
            if len(calls) == 1:
                refs = [self._submit(actor, *calls[0])]
            else:  # one return per call, and the seconds each took. Each call is an argument of its own:
                # Ray carries arguments up to 100 KB in the task itself, larger ones through its object store
                *refs, seconds = actor.run_calls.options(num_returns=len(calls) + 1).remote(*calls)
                for i, future in enumerate(futures):
                    future.seconds = (seconds, i)
            for future, ref in zip(futures, refs):
                future.ref = ref

    def call_seconds(self, future):
        if isinstance(future, _Deferred) and future.seconds is not None:
            seconds, i = future.seconds
            return self.get(seconds)[i]
        return None

    def _refs(self, futures):
        """Ray's futures for ``futures`` (one future or a list), unwrapping calls made in a block."""
        if isinstance(futures, list):
            return [self._refs(f) for f in futures]
        if isinstance(futures, _Deferred):
            if futures.ref is None:
                raise RollError("a call's result was asked for before the one_task_per_worker block that made it "
                                "ended (or the block raised, and the call was never sent)")
            return futures.ref
        return futures

    def get(self, futures):
        futures = self._refs(futures)
        try:
            return self.ray.get(futures, timeout=self.timeout_s)
        except self.ray.exceptions.RayTaskError as exc:
            raise_roll_error(exc)
        except self.ray.exceptions.RayActorError as exc:
            raise WorkerLostError(f"a worker process died: {str(exc).splitlines()[0]}") from exc
        except self.ray.exceptions.GetTimeoutError as exc:
            raise WorkerLostError(f"a worker did not answer within runtime.worker_timeout_s={self.timeout_s:g} s") from exc

    def wait(self, futures):
        futures = self._refs(list(futures))
        # A call the driver ran itself (a reward role placed there) has its result for a future: ready.
        inline = [i for i, f in enumerate(futures) if not isinstance(f, (self.ray.ObjectRef, self.ray.ObjectRefGenerator))]
        if inline:
            return inline
        ready, _ = self.ray.wait(list(futures), num_returns=1, fetch_local=False, timeout=self.timeout_s)
        if not ready:
            raise WorkerLostError(f"no worker answered within runtime.worker_timeout_s={self.timeout_s:g} s")
        ready = set(ready)
        return [i for i, f in enumerate(futures) if f in ready]

    def cancel(self, futures):
        for future in self._refs(list(futures)):
            self.ray.cancel(future)

    def gpus_by_node(self):
        return [int(n["Resources"].get("GPU", 0)) for n in self.ray.nodes() if n.get("Alive")]

    def reserve_devices(self, num_nodes, per_node):
        from ray.util.placement_group import placement_group, placement_group_table

        while len(self._node_groups) < num_nodes:
            pg = placement_group([{"GPU": per_node}], strategy="STRICT_PACK")
            try:
                self.ray.get(pg.ready(), timeout=120)
            except self.ray.exceptions.GetTimeoutError:
                raise RollError(f"could not reserve {per_node} GPUs on {num_nodes} node(s) within 120 s: "
                                f"the cluster has GPUs per node {self.gpus_by_node()}") from None
            self._node_groups.append(pg)
        return [placement_group_table(pg)["bundles_to_node_id"][0] for pg in self._node_groups[:num_nodes]]

    def stop(self, handle):
        if isinstance(handle, Hosted):  # it lives and dies with its host
            return
        try:
            self.ray.kill(handle, no_restart=True)
        except Exception:  # already dead
            pass
        self._actors = [a for a in self._actors if a is not handle]

    def kill_all(self, close_within: float | None = None):
        """Ask every worker to ``close``, wait up to ``close_within`` seconds (default
        :attr:`close_timeout_s`) for them, then end their processes. The process's end frees its
        memory and threads, but not what a worker started outside it: an environment's container or
        simulator, a sandbox's processes."""
        self._close_all(self.close_timeout_s if close_within is None else close_within)
        for handle in list(self._actors):
            self.stop(handle)

    close_timeout_s = 15.0

    def _close_all(self, timeout_s: float) -> None:
        # roll's workers have a close; any class may be spawned
        closing = [close.remote() for close in (getattr(h, "close", None) for h in self._actors) if close is not None]
        if not closing:
            return
        done, late = self.ray.wait(closing, num_returns=len(closing), timeout=timeout_s)
        for ref in done:
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayActorError:
                pass  # its process is already gone (a lost worker before a restart): nothing to close
            except Exception as exc:  # noqa: BLE001 - the run's own error, if any, matters more
                cause = getattr(exc, "cause", None) or exc
                warnings.warn(f"closing a worker failed: {type(cause).__name__}: {cause}", RuntimeWarning,
                              stacklevel=3)
        if late:
            warnings.warn(f"{len(late)} worker(s) did not close within {timeout_s:g} s (busy or hung); "
                          f"their processes are ended without it", RuntimeWarning, stacklevel=3)

    def shutdown(self, close_within: float | None = None):
        self.kill_all(close_within)
        for pg in self._node_groups:
            self.ray.util.remove_placement_group(pg)
        self._node_groups = []
        if self._owns_cluster and self.ray.is_initialized():
            self.ray.shutdown()


def make_executor(config) -> Executor:
    if config.executor == "local":
        return LocalExecutor()
    try:
        import ray  # noqa: F401
    except ImportError:
        raise RollError("executor 'ray' needs Ray: pip install ray, or run with executor=local") from None
    return RayExecutor(config.ray.address, config.ray.num_cpus, config.runtime.worker_timeout_s, _worker_env(config),
                       config.ray.worker_niceness)


def _worker_env(config) -> dict[str, str]:
    """How the workers' OpenMP teams wait between parallel regions, unless the user chose
    (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set).

    * With a scheduler that overlaps training (``async``), training and generation run at the same
      time. On CPU, OpenMP's default of spinning while it waits for work then burns the cores the
      other role needs: measured on 2 cores, an async step took 2.99 s with spinning threads and
      0.77 s with ``OMP_WAIT_POLICY=PASSIVE``, which the workers get. Not when every model role
      runs RL steps on one thread (``roles.<role>.torch_threads: 1``): a single thread never waits
      for a team, and spinning makes the phases where one role has every core (warm-up,
      evaluation) faster.
    * Otherwise (``sync``) the roles take turns, and spinning inside a call is what keeps a small
      model's many short operations fast (``PASSIVE``: 1.01 s a step against 0.59 s). But GNU
      OpenMP's default spin (300,000 rounds, about 10 ms on the 2-core machine of
      docs/benchmarks.md) outlasts the call: after every call a worker's idle team spins on the
      cores while the driver decodes, scores and sends the next call. ``GOMP_SPINCOUNT=30000``
      (about 1.7 ms there) ends the spin sooner: in alternating quickstart runs on Ray the time a
      step spends outside the worker's calls fell by 0.7-1.0 ms (6 of 6 pairs), the time per step
      by 2% (median), and the worker's CPU time by about 10 ms a step. Not when the controller runs
      inside the run's one worker (``ray.colocate_controller``): its work between calls is the
      team's own, as on the local executor, which keeps OpenMP's default."""
    from roll_core.plugins import get_plugins
    from roll_core.rollout import overlaps_training
    from roll_core.runtime.placement import controller_in_worker

    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return {}
    if controller_in_worker(config):  # one process: nothing else computes between its calls (runtime.controller)
        return {}
    if not overlaps_training(config.rollout.scheduler, get_plugins()):
        return {"GOMP_SPINCOUNT": "30000"}
    if all(config.rl_threads(name) == 1 for name in config.model_roles()):
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}
