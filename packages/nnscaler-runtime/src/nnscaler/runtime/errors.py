"""The exceptions nnscaler raises on purpose.

Every error names the user's thing (config field, module path, line of the user's model) and
says what to do. Catch `NnScalerError` to catch them all.

`ConfigError` also derives from `nnscaler.ir.config.ConfigError` (itself a `ValueError`), so an
`except` on either class sees config errors raised by the IR and by the runtime alike.
"""
from __future__ import annotations

try:  # the IR validates ComputeConfig and raises its own ConfigError; keep one family
    from nnscaler.ir.config import ConfigError as _IrConfigError
except ImportError:  # pragma: no cover - nnscaler-ir is a dependency; stay importable without it
    _IrConfigError = ValueError

__all__ = ["NnScalerError", "ConfigError", "ReuseError", "GenerationError", "PlanMismatchError"]


class NnScalerError(Exception):
    """Base class of every error nnscaler raises deliberately."""


class ConfigError(NnScalerError, _IrConfigError):
    """A configuration value (ComputeConfig, launch environment) cannot work."""


class ReuseError(NnScalerError):
    """Previously generated code cannot be reused under the requested ReuseType."""


class GenerationError(NnScalerError, RuntimeError):
    """Code generation failed; raised on every rank when rank 0 fails to generate."""


class PlanMismatchError(NnScalerError, RuntimeError):
    """Generated code, weights or a checkpoint belong to a different plan than the one running."""
