"""The exceptions the runtime raises on purpose.

All derive from `nnscaler.ir.errors.NnScalerError` (catch it to catch every error of nnscaler);
`ConfigError` and `GenerationError` are the IR's own classes, shared by every package.
"""
from __future__ import annotations

from nnscaler.ir import ConfigError, GenerationError, NnScalerError

__all__ = ["NnScalerError", "ConfigError", "ReuseError", "GenerationError", "PlanMismatchError"]


class ReuseError(NnScalerError):
    """Previously generated code cannot be reused under the requested ReuseType."""


class PlanMismatchError(NnScalerError, RuntimeError):
    """Generated code, weights or a checkpoint belong to a different plan than the one running."""
