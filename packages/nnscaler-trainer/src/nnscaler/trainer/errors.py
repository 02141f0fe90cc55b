"""The errors and warnings the Trainer raises on purpose."""
from __future__ import annotations

from nnscaler.ir import NnScalerError, NnScalerWarning

__all__ = ["TrainerConfigError", "TrainerConfigWarning", "TrainerError"]


class TrainerConfigError(NnScalerError, ValueError):
    """A setting of TrainerArgs (or the YAML / command line it came from) cannot work; the
    message names the key path (``optimizer.clip_gnorm``) and the fix."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


class TrainerConfigWarning(NnScalerWarning):
    """A setting that is ignored or overridden (e.g. sampler arguments the Trainer sets itself)."""


class TrainerError(NnScalerError, RuntimeError):
    """The run cannot go on (a checkpoint to resume from is missing, the world size differs from
    the config, ...); the message says what to do."""
