"""`Action` (a forward or backward of one stage and micro-batch) and the schedule errors: what
both the `Schedule` model (base.py) and its simulation (timeline.py) use."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import NnScalerError

__all__ = ["Action", "ScheduleError", "ScheduleDeadlockError"]


class ScheduleError(NnScalerError, ValueError):
    """A schedule's action lists are malformed (missing, duplicated or misplaced actions)."""


class ScheduleDeadlockError(ScheduleError):
    """The devices' action orders can never all complete: some device waits forever."""


@dataclass(frozen=True, order=True)
class Action:
    """One step of a pipeline schedule: forward (``'F'``) or backward (``'B'``) of micro-batch
    ``micro`` on stage ``stage``."""

    kind: str
    stage: int
    micro: int

    def __post_init__(self):
        if self.kind not in ("F", "B"):
            raise ScheduleError(f"Action.kind must be 'F' (forward) or 'B' (backward), got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}@s{self.stage}"
