"""The traced integer values of a graph (sizes and the arithmetic on them), recomputed from the
tensor shapes, so that an op can be re-run on its own with the arguments it was traced with."""
from __future__ import annotations

import operator
from typing import Any, Dict

from nnscaler.ir import IRGraph, Ref

__all__ = ["int_values", "substitute"]

_OPS = {f"operator.{name}": getattr(operator, name) for name in
        ("add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow", "getitem")}


def int_values(graph: IRGraph) -> Dict[int, Any]:
    """value id -> int for every int value whose origin is a shape or arithmetic on shapes."""
    known: Dict[int, Any] = {}
    for node in graph.nodes:
        outs = node.outputs
        if node.target in ("torch.Tensor.size", "getattr") and node.args and isinstance(node.args[0], Ref):
            shape = graph.value(node.args[0]).shape
            if shape is None or (node.target == "getattr" and list(node.args[1:]) != ["shape"]):
                continue
            dim = node.args[1] if node.target == "torch.Tensor.size" and len(node.args) > 1 else node.kwargs.get("dim")
            if isinstance(dim, int) and isinstance(outs, Ref):
                known[outs.id] = shape[dim]
            elif isinstance(outs, (list, tuple)):
                for ref, size in zip(outs, shape):
                    if isinstance(ref, Ref):
                        known[ref.id] = size
            continue
        fn = _OPS.get(node.target)
        if fn is not None and isinstance(outs, Ref):
            try:
                known[outs.id] = fn(*substitute(node.args, known))
            except Exception:  # an operand we cannot recompute
                continue
    return known


def substitute(obj, known: Dict[int, Any]):
    """`obj` with every Ref to a known int replaced by its value (other Refs kept)."""
    if isinstance(obj, Ref):
        return known.get(obj.id, obj)
    if isinstance(obj, list):
        return [substitute(x, known) for x in obj]
    if isinstance(obj, tuple):
        return tuple(substitute(x, known) for x in obj)
    if isinstance(obj, dict):
        return {k: substitute(v, known) for k, v in obj.items()}
    if isinstance(obj, slice):
        return slice(substitute(obj.start, known), substitute(obj.stop, known), substitute(obj.step, known))
    return obj
