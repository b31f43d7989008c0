"""Pipeline interface. A pipeline is the single controller: it owns the loop and drives the roles."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Pipeline(ABC):
    """Constructed as ``cls(config, executor)``; ``run()`` returns a summary dict. ``phase`` says
    what it is doing now (``roll run`` names it when interrupted)."""

    def __init__(self, config, executor):
        self.config, self.executor = config, executor
        self.phase = "start-up"

    def resume_hint(self) -> str:
        """Where a run stopped now would resume from (pipelines with checkpoints say more)."""
        return "the start"

    @abstractmethod
    def run(self) -> dict[str, Any]: ...
