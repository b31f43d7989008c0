"""Executors: where role workers live and how the driver calls them.

* ``local``: every worker is an object in the driver process. For debuggers and machines without Ray.
* ``ray``: every worker is a Ray actor. ``roll run`` starts a local Ray cluster when
  ``ray.address`` is unset and joins the given cluster otherwise.

Both expose the same API: ``spawn`` a :class:`WorkerGroup`, call methods on it (getting futures),
and ``get`` the results, so pipelines are written once.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

from roll_core.errors import RollError


class WorkerGroup:
    """The workers of one role."""

    def __init__(self, role: str, handles: list, executor: "Executor"):
        self.role, self.handles, self.executor = role, handles, executor

    def __len__(self) -> int:
        return len(self.handles)

    def call(self, method: str, /, *args, **kwargs) -> list:
        """Call ``method`` with the same arguments on every worker; returns futures."""
        return [self.executor.invoke(h, method, args, kwargs) for h in self.handles]

    def map(self, method: str, parts: list, /, **kwargs) -> list:
        """Call ``method(parts[i], **kwargs)`` on worker ``i``; returns futures."""
        if len(parts) != len(self.handles):
            raise ValueError(f"{self.role}: {len(parts)} parts for {len(self.handles)} workers")
        return [self.executor.invoke(h, method, (p,), kwargs) for h, p in zip(self.handles, parts)]


class Executor(ABC):
    name: str

    @abstractmethod
    def spawn(self, role: str, cls: type, args_per_worker: list[tuple]) -> WorkerGroup: ...

    @abstractmethod
    def invoke(self, handle, method: str, args: tuple, kwargs: dict) -> Any: ...

    @abstractmethod
    def get(self, futures): ...

    def wait(self, futures: list) -> list[int]:
        """Positions in ``futures`` of those that have finished (at least one; blocks until then)."""
        return list(range(len(futures)))

    def shutdown(self) -> None:
        pass


class LocalExecutor(Executor):
    """Runs every worker in the driver process; futures are the results themselves."""

    name = "local"

    def spawn(self, role, cls, args_per_worker):
        return WorkerGroup(role, [cls(*args) for args in args_per_worker], self)

    def invoke(self, handle, method, args, kwargs):
        return getattr(handle, method)(*args, **kwargs)

    def get(self, futures):
        return futures


class RayExecutor(Executor):
    """Workers are Ray actors. Worker exceptions surface in ``get`` with the worker's own message."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None):
        import ray

        self.ray = ray
        self._owns_cluster = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True,
                                      "configure_logging": True, "logging_level": "warning"}
            if address:
                kwargs["address"] = address
            else:
                kwargs["num_cpus"] = num_cpus or os.cpu_count()
                self._owns_cluster = True
            # Workers must find the same packages and plugins as the driver.
            kwargs["runtime_env"] = {"env_vars": {k: v for k, v in os.environ.items()
                                                  if k.startswith("ROLL_") or k == "PYTHONPATH"}}
            ray.init(**kwargs)

    def spawn(self, role, cls, args_per_worker):
        # Role workers are scheduled by placement (issue: device mapping), not by CPU count:
        # num_cpus=0 lets every role share a small machine.
        remote_cls = self.ray.remote(num_cpus=0)(cls)
        handles = [remote_cls.options(name=None).remote(*args) for args in args_per_worker]
        return WorkerGroup(role, handles, self)

    def invoke(self, handle, method, args, kwargs):
        return getattr(handle, method).remote(*args, **kwargs)

    def get(self, futures):
        try:
            return self.ray.get(futures)
        except self.ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if isinstance(cause, RollError):
                raise cause from None
            raise
        except self.ray.exceptions.RayActorError as exc:
            raise RollError(f"a worker process died: {exc}") from exc

    def wait(self, futures):
        ready, _ = self.ray.wait(list(futures), num_returns=1, fetch_local=False)
        ready = set(ready)
        return [i for i, f in enumerate(futures) if f in ready]

    def shutdown(self):
        if self._owns_cluster and self.ray.is_initialized():
            self.ray.shutdown()


def make_executor(config) -> Executor:
    if config.executor == "local":
        return LocalExecutor()
    try:
        import ray  # noqa: F401
    except ImportError:
        raise RollError("executor 'ray' needs Ray: pip install ray, or run with executor=local") from None
    return RayExecutor(config.ray.address, config.ray.num_cpus)
