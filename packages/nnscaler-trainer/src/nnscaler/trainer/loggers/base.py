"""The logger interface: what the Trainer calls on rank 0."""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["LoggerBase"]


class LoggerBase:
    """Subclass and name it in ``log: [{type: your.Logger, args: {...}}]``."""

    def setup(self, config: Dict[str, Any]) -> None:
        """Called once on rank 0 with the resolved config (plain data)."""

    def log_metrics(self, metrics: Dict[str, float], step: int, tag: str) -> None:
        """``tag`` is ``train`` or ``val``; ``step`` the global optimizer step."""
        raise NotImplementedError

    def finalize(self) -> None:
        """Flush and close."""
