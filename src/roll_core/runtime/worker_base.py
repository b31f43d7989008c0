"""The base of every role's worker (:mod:`roll_core.runtime.workers` for strategies,
:mod:`roll_core.runtime.reward_worker` for rewards).

It imports no torch, so a reward worker's process starts without loading torch and transformers
unless a reward it builds needs them: on Ray, 1.1 s from spawn to ready instead of 2.9 s on a
2-core machine, and 129 MiB resident instead of 311 (``benchmarks/bench_reward_worker.py``).
"""

from __future__ import annotations

import os
import time
from typing import Any


def bind_devices(devices) -> None:
    """Make the worker's mapped devices (local ids on its node) its visible CUDA devices. Runs
    before anything touches CUDA, so ``cuda:0`` is the first mapped device. Also keeps Hugging Face
    tokenizers single-threaded in the worker (they warn, and can deadlock, when a process that used
    them forks: reward sandboxes do), unless the user chose otherwise."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)


class Worker:
    """What every role's worker answers: its process, its placement, calls sent as one task, and
    workers of other roles it hosts. Imports no torch: a worker that computes without it (a
    reward's) starts without loading it."""

    hosted: dict[str, Any]  # role -> a worker built in this process by host()

    def pid(self) -> int:
        return os.getpid()

    def threads(self) -> int:
        """Intra-op threads torch uses in this worker now."""
        import torch

        return torch.get_num_threads()

    def placement(self) -> dict:
        """Where this worker runs: its process, its Ray node id (when on Ray) and its visible devices."""
        node = None
        try:
            import ray

            if ray.is_initialized():
                node = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return {"pid": os.getpid(), "node_id": node, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    # -- hosting another role's worker in this process (the hybrid engine, executor ray) ----------
    def host(self, role: str, cls: type, args: tuple) -> None:
        """Build ``cls(*args)``, a worker of ``role``, in this process: the executor's calls to it
        arrive through :meth:`call_hosted`, in order with this worker's own calls."""
        self.__dict__.setdefault("hosted", {})[role] = cls(*args)

    def call_hosted(self, role: str, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self.hosted[role], method)(*args, **kwargs)

    def close(self) -> None:
        """Release the workers this one hosts (the executor's ``stop``; see
        :meth:`roll_core.runtime.workers._StrategyWorker.close`)."""
        for worker in self.__dict__.pop("hosted", {}).values():
            worker.close()

    def run_calls(self, *calls: tuple[str | None, str, tuple, dict]) -> list:
        """Several calls sent as one task (:meth:`~roll_core.runtime.executor.Executor.one_task_per_worker`),
        run in order: ``(role, method, args, kwargs)`` each, ``role`` naming a hosted worker or None
        for this one. Returns their results and, last, the seconds each took. The first that raises
        ends the task: its error is every call's result."""
        results, seconds = [], []
        for role, method, args, kwargs in calls:
            start = time.perf_counter()
            results.append(self.call_hosted(role, method, args, kwargs) if role is not None
                           else getattr(self, method)(*args, **kwargs))
            seconds.append(time.perf_counter() - start)
        return [*results, seconds]
