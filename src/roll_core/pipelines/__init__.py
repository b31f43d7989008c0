"""Pipeline interface. A pipeline is the single controller: it owns the loop and drives the roles."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Pipeline(ABC):
    """Constructed as ``cls(config, executor)``; ``run()`` returns a summary dict."""

    def __init__(self, config, executor):
        self.config, self.executor = config, executor

    @abstractmethod
    def run(self) -> dict[str, Any]: ...
