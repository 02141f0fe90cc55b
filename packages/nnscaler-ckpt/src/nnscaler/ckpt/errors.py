"""The error every deliberate failure of the checkpoint package raises."""
from __future__ import annotations

from nnscaler.ir import NnScalerError

__all__ = ["CheckpointError", "describe"]


class CheckpointError(NnScalerError, RuntimeError):
    """A checkpoint cannot be written, read or used; the message names the file (or tensor) and
    what to do."""


def describe(exc: BaseException, rank: int) -> str:
    """The message every rank raises for an error met on `rank`: a CheckpointError's own message,
    anything else as ``rank r: Type: message``."""
    if isinstance(exc, CheckpointError):
        return str(exc)
    return f"rank {rank}: {type(exc).__name__}: {exc}"
