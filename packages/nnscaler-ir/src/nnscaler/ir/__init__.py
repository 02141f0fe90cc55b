"""nnscaler.ir: the intermediate representation.

`ComputeConfig`, `trace()` into an `IRGraph`, and the op registry with dimension annotations
(`register_op` for custom ops).
"""
from .config import ComputeConfig, OptionalComputeConfig
from .errors import ConfigError, GenerationError, NnScalerError, NnScalerWarning, TraceError, TracingWarning
from .config_checks import ConfigWarning
from .graph import IRGraph, InputSpec, Node, Ref, SourceLoc, TensorSpec, Value
from .plan_report import PlanReport
from .trace import trace

__all__ = [
    "ComputeConfig", "ConfigError", "ConfigWarning", "OptionalComputeConfig",
    "IRGraph", "InputSpec", "Node", "Ref", "SourceLoc", "TensorSpec", "Value", "PlanReport",
    "TraceError", "TracingWarning", "trace", "NnScalerError", "NnScalerWarning", "GenerationError",
]

from .annotation import AnnotationError, parse_annotation  # noqa: E402
from .registry import REGISTRY, register_op  # noqa: E402  (registers the built-in annotations)

__all__ += ["AnnotationError", "parse_annotation", "REGISTRY", "register_op"]
