"""The one family of errors and warnings nnscaler raises on purpose.

Every package derives its errors from `NnScalerError` and its warnings from `NnScalerWarning`
(both exported by ``nnscaler`` itself), so a user catches or filters all of nnscaler's with one
class. Each error names the user's thing (a config field, a module path, a line of the model) and
says what to do. The classes that more than one package raises live here; the others next to the
code that raises them.
"""
from __future__ import annotations

__all__ = ["NnScalerError", "NnScalerWarning", "ConfigError", "GenerationError", "TraceError",
           "TracingWarning"]


class NnScalerError(Exception):
    """Base class of every error nnscaler raises deliberately."""


class NnScalerWarning(UserWarning):
    """Base class of every warning nnscaler emits."""


class ConfigError(NnScalerError, ValueError):
    """A configuration value (ComputeConfig, launch environment) cannot work; the message names the
    field and the fix."""


class GenerationError(NnScalerError, RuntimeError):
    """The planned graph cannot be turned into code, or generation failed on rank 0 (raised on
    every rank); the message names the op and the reason."""


class TraceError(NnScalerError, RuntimeError):
    """Tracing the user's module failed; the message names the user's source line."""


class TracingWarning(NnScalerWarning):
    """Something in the user's forward that the generated code cannot follow for other inputs."""
