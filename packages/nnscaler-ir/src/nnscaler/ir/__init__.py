"""nnscaler.ir: the intermediate representation.

`ComputeConfig`, `trace()` into an `IRGraph`, and the op registry with dimension annotations
(`register_op` for custom ops).
"""
from .config import ComputeConfig, ConfigError, OptionalComputeConfig
from .config_checks import ConfigWarning
from .graph import IRGraph, InputSpec, Node, Ref, SourceLoc, TensorSpec, Value
from .plan_report import PlanReport
from .trace import TraceError, TracingWarning, trace

__all__ = [
    "ComputeConfig", "ConfigError", "ConfigWarning", "OptionalComputeConfig",
    "IRGraph", "InputSpec", "Node", "Ref", "SourceLoc", "TensorSpec", "Value", "PlanReport",
    "TraceError", "TracingWarning", "trace",
]

try:  # the op registry (annotations) lives beside the tracer
    from .annotation import AnnotationError, parse_annotation
    from .registry import REGISTRY, register_op
    from . import builtin_ops as _builtin_ops  # noqa: F401  (registers the built-in annotations)
    __all__ += ["AnnotationError", "parse_annotation", "REGISTRY", "register_op"]
except ImportError:  # pragma: no cover - only while the registry is being written
    pass
