"""Guards: Python decisions the forward takes on a traced tensor's *value*.

``if (mask == 1).all():``, ``bool(t)``, ``t.item()``, ``int(t)``, ``float(t)``, ``t.tolist()``, a
tensor used as a Python index, ``np.asarray(t)``: the tracer sees one value and the program
keeps the branch (or the number) taken while tracing. Each such read on an in-graph tensor
becomes a *guard* node (target `GUARD_TARGET`, no outputs, kept by dead-code elimination, in
program order) whose kwargs hold the kind of read, the value seen at trace time, the graph
inputs the value derives from and the model line that called into a library. Codegen renders it
as a call of ``nnscaler.runtime.guards.check``, which raises ``GuardError`` on every rank when
the data takes another branch.

What is compared (documented in docs/tracing.md):
* ``bool`` / ``item`` / ``int`` / ``float`` / ``index``: the value itself; integers and booleans
  exactly, floating-point values within a relative tolerance of the dtype (a tensor-parallel
  plan computes a sum in another order);
* ``tolist`` / ``array``: the whole tensor when it has at most `WHOLE_LIMIT` elements, else a
  digest (float64 sum and position-weighted sum) compared with that tolerance.
Shapes are not guarded: `constant_folding` keeps its meaning (reading ``x.shape`` is not a value
read).
"""
from __future__ import annotations

import math
import os
import sys
from typing import Any, Dict, List, Optional

import torch

from ..errors import TracingWarning
from ..graph import IRGraph, Node, Ref, SourceLoc
from ..user_code import _nnscaler_dirs, is_internal
from .surface import TracerSurface

GUARD_TARGET = "nnscaler.runtime.guards.check"
WHOLE_LIMIT = 1024  # tolist()/__array__ of more elements are compared through a digest

READ_KIND = {"__bool__": "bool", "item": "item", "__int__": "int", "__float__": "float",
             "__index__": "index", "tolist": "tolist", "__array__": "array",
             "numpy": "array"}
READ_TEXT = {"bool": "bool(tensor) (an `if`, `while`, `and`/`or` or assert on a tensor)",
             "item": "tensor.item()", "int": "int(tensor)", "float": "float(tensor)",
             "index": "a tensor used as a Python index", "tolist": "tensor.tolist()",
             "array": "a tensor turned into a NumPy array"}


def is_guard(node: Node) -> bool:
    return node.target == GUARD_TARGET


def guards_of(graph: IRGraph) -> List[Node]:
    return [n for n in graph.nodes if is_guard(n)]


def digest(t: torch.Tensor) -> List[float]:
    """[sum, position-weighted sum] in float64: cheap, and changes when any element does."""
    flat = t.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device).remainder_(97).add_(1)
    return [float(flat.sum()), float((flat * weights).sum())]


def traced_value(kind: str, tensor: torch.Tensor, result) -> Any:
    """What the guard compares against at run time (JSON-able)."""
    if kind == "bool":
        return bool(result)
    if kind in ("item", "int", "float", "index"):
        return result.item() if hasattr(result, "item") else result
    if tensor.numel() > WHOLE_LIMIT:
        return {"digest": digest(tensor)}
    return tensor.detach().cpu().tolist()


def model_frame(tracer: TracerSurface, start_depth: int = 2):
    """(innermost user frame, the model's frame that called into a library or None).

    The innermost frame outside nnscaler/torch is where the value is read (for Hugging Face
    models a line of `transformers`); the model's frame is the innermost frame whose `self` is a
    module of the traced model, when that is another frame (e.g. ``LlamaModel.forward`` calling
    ``create_causal_mask``)."""
    frame = sys._getframe(start_depth)
    inner = None
    while frame is not None:
        if not _ours(frame.f_code.co_filename):
            if inner is None:
                inner = frame
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module) and tracer.module_path(owner) is not None:
                return _loc(inner), (_loc(frame) if frame is not inner else None)
        frame = frame.f_back
    return (_loc(inner) if inner is not None else None), None


def _ours(filename: str) -> bool:
    """nnscaler, torch or the standard library. Installed libraries (transformers) are not: the
    value is read there on behalf of the model, and the user needs that line too."""
    if filename.startswith("<") or filename.startswith(_nnscaler_dirs() + (_TORCH_DIR,)):
        return True
    if "site-packages" in filename or "dist-packages" in filename:
        return False
    return is_internal(filename)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _loc(frame) -> SourceLoc:
    import linecache
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return SourceLoc(frame.f_code.co_filename, frame.f_lineno, code, frame.f_code.co_qualname)


def derives_from(tracer: TracerSurface, ref: Ref) -> str:
    """The user-visible origin of a value: the forward arguments (or parameters) it is computed from."""
    producers = tracer.producer_index()
    seen, stack, inputs, params = set(), [ref.id], [], []
    while stack:
        vid = stack.pop()
        if vid in seen:
            continue
        seen.add(vid)
        if vid in tracer.input_names:
            inputs.append(tracer.input_names[vid])
            continue
        node = producers.get(vid)
        if node is None:
            if vid in tracer.param_names:
                params.append(tracer.param_names[vid])
            continue
        if node.target in _SHAPE_READS or (node.target == "getattr" and list(node.args[1:]) == ["shape"]):
            continue  # a shape, not the values (guards are about values)
        stack.extend(r.id for r in node.input_refs())
    if inputs:
        names = ", ".join(f"`{n}`" for n in sorted(set(inputs)))
        return f"forward's argument{'s' if len(set(inputs)) > 1 else ''} {names}"
    if params:
        shown = sorted(set(params))
        more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
        return f"the model's parameters/buffers {', '.join(shown[:3])}{more} (they change as it trains)"
    return ""


_SHAPE_READS = ("torch.Tensor.size", "torch.Tensor.numel", "torch.Tensor.dim")


def record_value_read(tracer: TracerSurface, name: str, tensor: torch.Tensor, result) -> Node:
    """Add the guard node for `name` (a _VALUE_READS entry) read on in-graph `tensor`."""
    kind = READ_KIND[name]
    ref = tracer.ref_of_tensor(tensor)
    inner, via = model_frame(tracer, 3)
    kwargs: Dict[str, Any] = {"read": kind, "traced": traced_value(kind, tensor, result),
                              "cause": derives_from(tracer, ref)}
    if via is not None:
        kwargs["via"] = str(via)
    node = tracer.add_node(GUARD_TARGET, [ref], kwargs, None)
    node.source = inner
    if kind == "bool":
        node.kwargs["decision"] = tracer.next_decision()
    return node


def trace_warning(node: Node, handled: str) -> str:
    """The trace-time message for a guard: where, what it derives from, and what happens now."""
    kw = node.kwargs
    src = node.source
    # the line's code is not repeated: Python prints it under the message (warn_explicit)
    where = f" at {src.file}:{src.line}" + (f" in {src.function}" if src.function else "") if src else ""
    via = f" (called from the model's line {kw['via']})" if kw.get("via") else ""
    cause = (f"; the value derives from {kw['cause']}" if kw.get("cause") else
             "; the value derives from no forward argument or parameter, only from shapes and constants")
    shown = kw["traced"] if not isinstance(kw["traced"], (list, dict)) else "the traced tensor"
    return (f"forward reads a tensor's value in Python ({READ_TEXT[kw['read']]}){where}{via}{cause}. "
            f"While tracing it was {shown!r}; {handled}")


GUARDED = ("the generated code keeps the branch taken while tracing and checks it on every step: data "
           "that takes another branch raises nnscaler.runtime.GuardError. Trace with an example that takes "
           "the branch your data takes, or compute it with tensor ops (torch.where, masking)")
BOTH = "both branches are generated and the program chooses at run time"


def close(a: float, b: float, dtype: Optional[str]) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or (isinstance(a, int) and isinstance(b, int)):
        return a == b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=tolerance(dtype), abs_tol=tolerance(dtype) * 1e-3)


def tolerance(dtype: Optional[str]) -> float:
    """Relative tolerance for floating-point guards: rounding of another summation order."""
    if dtype in ("float64", "complex128"):
        return 1e-9
    if dtype in ("float16", "bfloat16"):
        return 1e-2
    return 1e-4


def warn_guards(graph: IRGraph) -> None:
    """One TracingWarning per user line that reads a tensor's value, saying what the program does."""
    import warnings
    seen = set()
    for node in guards_of(graph):
        key = (node.source.file, node.source.line) if node.source else None
        if key in seen:
            continue
        seen.add(key)
        handled = BOTH if node.kwargs.get("branches") else GUARDED
        if node.kwargs.get("skipped"):  # nnscaler.ir.tracer.branches.MAX_FLIPS
            handled += f" (its other branch was not traced: {node.kwargs['skipped']})"
        message = trace_warning(node, handled)
        if node.source is None:
            warnings.warn(message, TracingWarning)
        else:
            warnings.warn_explicit(message, TracingWarning, node.source.file, node.source.line)
