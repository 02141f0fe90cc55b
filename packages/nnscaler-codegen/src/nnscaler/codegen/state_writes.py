"""In-place updates of parameters and buffers in forward stay updates of the stored tensors.

A forward may update its own weights under ``torch.no_grad()`` (a max-norm constraint
``w.div_(w.norm(...))``, a decay ``w.mul_(0.9)``). The trace records the in-place op on the
parameter's value; a plan may run that op on another layout than the one the parameter is stored
in (the stored replica split by columns, say), so the op writes a converted copy and the stored
tensor would keep its old value (or get only a slice of the new one). After such an op the
generated code therefore converts the op's result to the stored layout and copies it into the
stored tensor, under no_grad, so the next step starts from the updated weights on every rank,
as one process does.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List

from nnscaler.ir import IRGraph, Node, Ref

if TYPE_CHECKING:
    from .conversions import Adapter
    from .layouts import UnitPlan

__all__ = ["StateWrites"]


class StateWrites:
    """Write-back lines for the in-place ops of one graph that update a parameter or buffer."""

    def __init__(self, graph: IRGraph, unit: "UnitPlan", names: Dict[int, str]):
        self.unit, self.names = unit, names
        self.stored_name = {s.value.id: s.name for s in graph.tensor_specs()}

    def lines(self, node: Node, adapt: "Adapter") -> List[str]:
        """Lines after `node`'s statement: none unless it wrote a converted copy of a stored tensor."""
        if not node.inplace or not node.args or not isinstance(node.args[0], Ref):
            return []
        target = node.args[0].id
        name = self.stored_name.get(target)
        if name is None or target not in adapt.overrides or not isinstance(node.outputs, Ref):
            return []  # not a parameter/buffer, or the op wrote the stored tensor itself
        lines: List[str] = []
        var = adapt.convert(node.outputs.id, self.unit.stored[name], False, lines) or self.names[node.outputs.id]
        return lines + [f"{self.names[target]}.copy_({var})  # the op wrote a converted copy of {name}"]
