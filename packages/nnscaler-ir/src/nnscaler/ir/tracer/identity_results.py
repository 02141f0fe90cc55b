"""Ops that return their input itself: each Python reference keeps its own graph value.

The recorder finds a tensor's graph value by object identity (``id(tensor)``). Some ops return
the very object they were given when there is nothing to do: ``x.float()`` on a float32 tensor,
``x.to(x.dtype)``, ``x.type(torch.float32)``, ``x.type_as(x)``, ``x.contiguous()`` on a
contiguous tensor, ``x.to(device)`` / ``x.cpu()`` on its own device, ``F.dropout`` in eval mode.
Binding that object to the op's output would rebind ``x`` too: every later use of ``x`` would
read the op's output. In the generated code ``h.type_as(x)`` then becomes ``h.type_as(float_4)``,
a cast to float32 even once the module runs in bf16 (``apply_precision`` after tracing).

So the result of such a call that did not change its input (not in place, the input's version
counter unchanged) is handed to the user's code as a distinct alias of the same storage (a
view), bound to the op's new value; the input object keeps the value it had. In-place ops
(``add_``, ``x[i] = v``, ``out=``) still rebind: their output is the input's next version.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from ..tree import iter_tensors
from .surface import TracerSurface

__all__ = ["traced_inputs", "returned_unchanged", "distinct_alias"]


def traced_inputs(tracer: TracerSurface, *objs) -> Dict[int, Tuple[torch.Tensor, int]]:
    """id -> (tensor, version counter) of every tensor in `objs` that is already a graph value."""
    seen = {}
    for t in iter_tensors(objs):
        if tracer.is_bound(t):
            seen[id(t)] = (t, _version(t))
    return seen


def returned_unchanged(tensor: torch.Tensor, inputs: Dict[int, Tuple[torch.Tensor, int]]) -> bool:
    """`tensor` is one of the call's traced inputs, returned as is and not written to."""
    hit = inputs.get(id(tensor))
    return hit is not None and hit[0] is tensor and _version(tensor) == hit[1]


def distinct_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor object with `tensor`'s storage, values, dtype and autograd history (a view;
    made with grad on so it requires grad exactly when `tensor` does, also in a no_grad region)."""
    with torch._C.DisableTorchFunction(), torch.enable_grad():
        try:
            return tensor.view_as(tensor)
        except RuntimeError:  # a layout without views (nested tensors): a detached twin
            alias = tensor.detach()
            if tensor.requires_grad:
                alias.requires_grad_(True)
            return alias


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1
