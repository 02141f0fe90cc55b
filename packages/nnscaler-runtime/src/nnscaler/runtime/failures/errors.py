"""The three errors a rank raises when a step cannot go on because of another rank (or the job's
state): a peer failed or died, a collective timed out, a step after a failure is refused."""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import NnScalerError

__all__ = ["PeerFailedError", "StepRefusedError", "CollectiveTimeoutError"]


class PeerFailedError(NnScalerError, RuntimeError):
    """Another rank failed (or died) during this step; `rank` is that rank, `reason` its error
    (None when it died without one), `died` whether its process ended without reporting."""

    def __init__(self, message: str, rank: Optional[int], reason: Optional[str], died: bool):
        super().__init__(message)
        self.rank, self.reason, self.died = rank, reason, died


class StepRefusedError(NnScalerError, RuntimeError):
    """A step on a process whose earlier step failed (here or on a peer): restart the job."""


class CollectiveTimeoutError(NnScalerError, RuntimeError):
    """A collective waited longer than the default process group's timeout: `missing` are the
    ranks of its group that never arrived (alive, but not waiting in any collective of nnscaler),
    `what` the collective this rank waited in."""

    def __init__(self, message: str, missing: Sequence[int], what: str, reason: str = ""):
        super().__init__(message)
        self.missing, self.what, self.reason = tuple(missing), what, reason or message
