"""Layout conversions in generated code: the collectives (``nr.comm.*``, see adapters.py) that
give each consumer its input in the layout it needs.

One `Adapter` serves one body of generated code (the forward, or one pipeline stage) on the ranks
of that body. `inputs(node)` emits the conversions an op needs and records, in `overrides`, the
variable the op reads instead of each converted value; a conversion already made is reused
(`converted`, keyed by value, placement and gradient mode) until a block that may not run
(a recompute segment, a branch) restores the cache. `reads` collects the variables the emitted
conversions read, so a recompute segment knows its free variables (recompute.py).
"""
from __future__ import annotations

from typing import Dict, List, Optional

from nnscaler.ir import IRGraph, Node, Replicate, iter_refs

from .adapters import transition_steps
from .errors import GenerationError
from .layouts import UnitPlan, is_shape_query
from .render import Renderer, python_name

__all__ = ["Adapter"]

R = Replicate()


class Adapter:
    """Inserts the collectives that turn each value into the layout its consumer needs."""

    def __init__(self, unit: UnitPlan, names: Dict[int, str], taken: set, ranks: tuple, received=frozenset()):
        self.unit, self.names, self.taken, self.ranks = unit, names, taken, ranks
        self.received = set(received)  # values that arrived from another stage replicated
        self.converted: Dict[tuple, str] = {}  # (value id, placement, grad_partial) -> variable
        self.overrides: Dict[int, str] = {}  # value id -> the variable the current op reads instead
        self.reads: set = set()  # variables read by the conversions emitted (or reused) so far

    def convert(self, ref_id: int, dst, grad_partial: bool, lines: List[str]) -> Optional[str]:
        """The variable holding value `ref_id` in placement `dst` (appending the collectives that
        make it to `lines`, or reusing an earlier conversion); None when it already is in `dst`."""
        src = R if ref_id in self.received else self.unit.produced[ref_id]
        steps = transition_steps(src, dst, grad_partial=grad_partial)
        if not steps:
            return None
        key = (ref_id, repr(dst), grad_partial)
        if key not in self.converted:
            var = self.names[ref_id]
            self.reads.add(var)
            for fname, kwargs in steps:
                new = python_name(f"{var.replace('self.', '')}_{fname}", self.taken)
                extra = "".join(f", {k}={v!r}" for k, v in kwargs.items())
                if fname == "grad_all_reduce" and ref_id in self.unit.params:
                    extra += ", weight=True"  # a parameter: passed on as a view, not copied
                lines.append(f"{new} = nr.comm.{fname}({var}{extra}, ranks={self.ranks!r})")
                var = new
            self.converted[key] = var
        self.reads.add(self.converted[key])
        return self.converted[key]

    def inputs(self, node: Node) -> List[str]:
        """The conversions `node` needs (its `overrides` set for the renderer)."""
        lines: List[str] = []
        self.overrides = {}
        if is_shape_query(node):  # reads only the shape: the local value as it is
            return lines
        for need in self.unit.needs[node.id]:
            self.override(node, need.ref_id, self.convert(need.ref_id, need.placement, need.grad_partial, lines))
        return lines

    def override(self, node: Node, ref_id: int, var: Optional[str]) -> None:
        """`node` reads `var` for value `ref_id` (nothing when None)."""
        if var is None:
            return
        if self.overrides.get(ref_id, var) != var:
            raise GenerationError(f"op {node.describe()} reads one tensor in two different layouts")
        self.overrides[ref_id] = var

    def renderer_for(self, node: Optional[Node]) -> Renderer:
        return Renderer({**self.names, **self.overrides}) if node is not None else Renderer(self.names)

    def read_name(self, ref_id: int) -> str:
        """The variable the current op's statement reads for value `ref_id`."""
        return self.overrides.get(ref_id, self.names[ref_id])

    def outputs(self, graph: IRGraph) -> List[str]:
        """The forward's outputs are full values on every rank of the unit."""
        lines: List[str] = []
        for ref in sorted(set(r.id for r in iter_refs(graph.output))):
            if graph.values[ref].is_tensor:
                var = self.convert(ref, R, False, lines)
                if var is not None:
                    self.names[ref] = var
        return lines
