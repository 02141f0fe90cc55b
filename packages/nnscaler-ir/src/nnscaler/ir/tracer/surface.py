"""The tracer's public surface: what the code around the recorder may ask of a running trace.

`Tracer` (recorder.py) records the user's forward; the helpers that turn parts of a forward into
nodes work through it: value reads into guards (guards.py), user autograd Functions into one node
each (kept_functions.py), results that are their own input into a new value
(identity_results.py), the model's state around the forward (trace_state.py), ints read off shapes
(symbolic_int.py), and the wrappers of registered ops (ops/registry.py, ops/moe.py, through
``tracing_context.current_tracer()``). `TracerSurface` is every name they use, typed; they name
this type, never the class, so none of them imports the recorder (which imports several of them),
and nothing outside recorder.py touches a private name of the tracer
(tests/ir/test_tracer_surface.py checks both).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, runtime_checkable

import torch

from ..graph import Node, Ref

__all__ = ["TracerSurface"]


@runtime_checkable
class TracerSurface(Protocol):
    """A running trace, as its helpers see it."""

    constant_folding: bool
    """Ints read off shapes are plain constants (no `TracedInt`, no size ops recorded)."""
    input_names: Dict[int, str]
    """Graph input value id -> the forward argument it is (``"attention_mask"``, ``"batch['mask']"``)."""
    param_names: Dict[int, str]
    """Parameter or buffer value id -> its full name."""
    function_grad: List[Tuple[type, bool]]
    """(class, the caller's grad mode) of every ``autograd.Function.apply`` running now, innermost last."""

    # -- values ----------------------------------------------------------------------------------
    def new_value(self, obj: Any, hint: str) -> Ref:
        """A fresh graph value for a tensor, an int or another object (`hint` names it)."""

    def bind_tensor(self, tensor: torch.Tensor, ref: Ref) -> None:
        """From now on `tensor` (this very object) is the graph value `ref`."""

    def is_bound(self, tensor: torch.Tensor) -> bool:
        """Whether this very tensor object already is a graph value (input, parameter, buffer, op
        output or captured constant)."""

    def ref_of_tensor(self, tensor: torch.Tensor) -> Ref:
        """The graph value of `tensor`; a tensor the trace has not seen becomes a captured constant."""

    def to_refs(self, obj: Any) -> Any:
        """`obj` (nested tuples, lists, dicts, slices) with every tensor and traced int replaced by its
        `Ref`; TypeError for an object generated code could not rebuild."""

    def wrap_outputs(self, result: Any, hint: str, inputs: Optional[dict] = None) -> Tuple[Any, Any]:
        """(refs, result): a fresh value for every tensor (and traced int) of a call's `result`, and
        the result the user's code gets (an input returned unchanged comes back as a distinct alias;
        `inputs` from ``identity_results.traced_inputs``)."""

    # -- recording -------------------------------------------------------------------------------
    def add_node(self, target: str, args: Any, kwargs: Any, outputs: Any, annotation: Optional[str] = None,
                 inplace: bool = False) -> Node:
        """Append an op to the graph, at the current module path and user source line, with the user's
        grad mode and autocast region."""

    def record_int_op(self, op: Callable, args: tuple) -> int:
        """Record integer arithmetic on traced ints (``operator.mul``...) and return the traced result."""

    def record_custom_op(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """Record a call of a registered op as one node and return its result."""

    def next_decision(self) -> int:
        """The number of the next boolean decision on a tensor value (the guards' ``decision``)."""

    # -- where the forward is ------------------------------------------------------------------
    def module_path(self, module: torch.nn.Module) -> Optional[str]:
        """The path of a module of the traced model (``"h.0.attn"``, ``""`` for the root); None for
        a module outside it."""

    def producer_index(self) -> Dict[int, Node]:
        """Value id -> the node that produced it, over the ops recorded so far."""

    def grad_enabled(self) -> bool:
        """The user's grad mode now (inside an autograd Function's forward: its caller's)."""
