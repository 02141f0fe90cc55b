"""Both branches of a Python decision on a tensor value in generated code (nnscaler.ir.tracer.branches).

The decision's guard becomes ``_branch_<id> = bool(<tensor>)``; an op of one branch only runs
under ``if _branch_<id>:`` (or ``if not ...``), together with the layout conversions it needs;
an op whose arguments differ between the branches gets ``(a if _branch_<id> else b)`` there, and
the conversions of a value used on one side only are emitted under that side's ``if``.
Conversions made inside a branch are not reused after it; a guard inside a branch is checked on
every rank, outside the ``if`` (codegen/guards.py). Values computed inside a branch, and
values read through a branch argument, are never deleted early (``del``): the generated code
cannot know there which branch ran.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from nnscaler.ir import IRGraph, Node, Ref, branch_refs, is_guard

from .layouts import Need, is_shape_query
from .render import RawExpr


def decision_var(guard_id: int) -> str:
    return f"_branch_{guard_id}"


def decisions_tested(node: Node) -> set:
    """The decisions whose variable `node`'s statement tests."""
    return ({node.branch[0]} if node.branch is not None else set()) | {gid for _, _, gid, _, _ in node.branch_args}


def keep_alive(graph: IRGraph) -> set:
    """Value ids the generated code must not `del` early (see the module docstring)."""
    inside = {r.id for n in graph.nodes if n.branch is not None for r in n.output_refs()}
    return inside | branch_refs(graph)


class BranchChoice(RawExpr):
    def __init__(self, guard_id: int, when_true, when_false):
        self.var, self.when_true, self.when_false = decision_var(guard_id), when_true, when_false

    def render(self, renderer) -> str:
        return f"({renderer.value(self.when_true)} if {self.var} else {renderer.value(self.when_false)})"


def with_branch_args(node: Node, args, kwargs):
    """`args`, `kwargs` with the arguments that differ between branches as BranchChoice."""
    args, kwargs = list(args), dict(kwargs)
    for where, key, gid, when_true, when_false in node.branch_args:
        (args if where == "args" else kwargs)[key] = BranchChoice(gid, when_true, when_false)
    return args, kwargs


def branch_if(gid: int, side: bool) -> str:
    """The `if` line of one side of decision `gid`."""
    return f"if {'' if side else 'not '}{decision_var(gid)}:"


def branch_emit(node: Node, adapt, graph: IRGraph) -> Optional["BranchEmit"]:
    if node.branch is None and not node.branch_args:
        return None
    return BranchEmit(node, adapt, graph)


class BranchEmit:
    """Conversions and statement of one op that runs in one branch or reads branch arguments."""

    def __init__(self, node: Node, adapt, graph: IRGraph):
        self.node, self.adapt, self.graph = node, adapt, graph
        self.side_lines: Dict[tuple, List[str]] = {}

    def inputs(self) -> List[str]:
        node, adapt = self.node, self.adapt
        before = dict(adapt.converted)
        if node.branch is not None:  # everything runs inside the branch
            lines = adapt.inputs(node)
            self._restore = before
            return lines
        sides = self._sides()
        adapt.overrides = {}
        common: List[str] = []
        needs = [] if is_shape_query(node) else adapt.unit.needs[node.id]
        deferred = []
        for need in needs:
            if need.ref_id in sides:
                deferred.append(need)
            else:
                self._convert(need, common)
        inside_start = dict(adapt.converted)
        for need in deferred:
            gid, side, _ = sides[need.ref_id][0]
            self._convert(need, self.side_lines.setdefault((gid, side), []))
        placements = {need.ref_id: need for need in needs}
        for ref_id, places in sides.items():  # the other side's value: the placement of the base one
            for gid, side, base in places:
                need = placements.get(base) if base != ref_id else None
                if need is not None:
                    self._convert(Need(ref_id, need.placement, need.grad_partial),
                                  self.side_lines.setdefault((gid, side), []))
        adapt.converted = inside_start  # conversions inside a branch are not reused outside it
        self._restore = None
        return common

    def _convert(self, need: Need, lines: List[str]) -> None:
        self.adapt.override(self.node, need.ref_id,
                            self.adapt.convert(need.ref_id, need.placement, need.grad_partial, lines))

    def _sides(self) -> Dict[int, list]:
        """value id -> [(gid, side, base id)...]: values read on one side of a branch argument only.
        The first entry is the base argument's own value; later ones the other side's."""
        out: Dict[int, list] = {}
        for where, key, gid, when_true, when_false in self.node.branch_args:
            base = (self.node.args if where == "args" else self.node.kwargs)[key]
            base_side = isinstance(base, Ref) and isinstance(when_true, Ref) and base.id == when_true.id
            if isinstance(base, Ref):
                out.setdefault(base.id, []).insert(0, (gid, base_side, base.id))
                other = when_false if base_side else when_true
                if isinstance(other, Ref):
                    out.setdefault(other.id, []).append((gid, not base_side, base.id))
        # a value read on both sides (or also outside a branch argument) is converted outside
        plain = [r.id for r in self.node.input_refs()]
        return {k: v for k, v in out.items() if plain.count(k) <= 1 and len({(g, s) for g, s, _ in v}) == 1}

    @property
    def hoisted(self) -> bool:
        """A guard inside a branch: its check runs on every rank, after the branch's conversions
        (codegen/guards.py)."""
        return self.node.branch is not None and is_guard(self.node) and not self.node.kwargs.get("branches")

    def wrap(self, conversions: List[str], own: List[str]):
        node = self.node
        if node.branch is not None:
            gid, side = node.branch
            self.adapt.converted = self._restore
            if self.hoisted:
                return ([branch_if(gid, side)] + ["    " + line for line in conversions] if conversions else []), own
            return [], [branch_if(gid, side)] + ["    " + line for line in conversions + own]
        blocks = []
        for (gid, side), lines in self.side_lines.items():
            if lines:
                blocks += [branch_if(gid, side)] + ["    " + line for line in lines]
        return conversions + blocks, own


def decision_statement(node: Node, value: str) -> List[str]:
    """The decision both of whose branches are in the program (`value`: the rendered tensor)."""
    return [f"{decision_var(node.id)} = bool({value})  # both branches are generated"]
