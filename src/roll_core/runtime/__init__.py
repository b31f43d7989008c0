"""Distributed runtime: role workers and the executors that host them (``local`` or ``ray``)."""

from roll_core.runtime.executor import Executor, LocalExecutor, RayExecutor, WorkerGroup, make_executor

__all__ = ["Executor", "LocalExecutor", "RayExecutor", "WorkerGroup", "make_executor"]
