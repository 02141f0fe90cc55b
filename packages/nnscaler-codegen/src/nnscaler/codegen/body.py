"""The body of a generated method: this rank's ops in program order.

`BodyEmitter` holds what emitting one body needs (the graph, the value names, the `Adapter`, the
random-op and batch-norm rewrites, the write-backs of in-place updates) and what it learns along
the way (which variables are defined, the user line of the last comment). `emit(nodes, head)`
gives a `Lines`: each op's layout conversions, the user's source line as a comment above the ops
of a new line, the op's statement, and a ``del`` of the values read for the last time.
Consecutive ops of one ``with torch.no_grad()`` / ``torch.autocast`` region or of one branch of a
decision share one block; ops of a recompute group become a checkpointed function (recompute.py).
"""
from __future__ import annotations

from typing import Dict, List, Optional

from nnscaler.ir import IRGraph, Node, iter_refs

from .branches import branch_emit, keep_alive
from .conversions import Adapter
from .collective_ops import collective_call
from .layouts import UnitPlan
from .lines import Lines
from .naming import Naming
from .random_streams import RandomOps
from .recompute import emit_recompute
from .state_writes import StateWrites
from .statements import context_line, describe_source, rescale_sizes, statement
from .sync_batchnorm import SyncBatchNorm

__all__ = ["BodyEmitter", "last_uses"]


class BodyEmitter:
    """Emits the ops of one body (the forward, or one stage) for the ranks `adapter` serves."""

    def __init__(self, graph: IRGraph, naming: Naming, adapter: Adapter, unit: UnitPlan, keep: set,
                 rnd: Optional[RandomOps] = None, sbn: Optional[SyncBatchNorm] = None, decisions_out=()):
        self.graph, self.naming, self.adapter, self.unit = graph, naming, adapter, unit
        self.names = naming.names
        self.keep = set(keep)  # values never deleted (the body's outputs)
        self.rnd, self.sbn = rnd, sbn
        self.writes = StateWrites(graph, unit, self.names)
        self.prev_src: Optional[str] = None  # the user line of the last source comment
        self.defined: set = set()  # variables the body has defined so far
        self.last_use: Dict[int, List[int]] = {}
        self.conditions: Dict[str, tuple] = {}  # variable -> (decision id, side): assigned on that branch only
        self.decisions_out = set(decisions_out)  # decisions the body returns (sent to later pipeline stages)

    def emit(self, nodes: List[Node], head: List[str], head_values=()) -> Lines:
        """`head` lines, then `nodes` in order (recompute groups as checkpointed functions)."""
        body = Lines(list(head))
        self.last_use = last_uses(nodes, self.keep | keep_alive(self.graph))
        self.defined = {self.names[r.id] for i in self.graph.inputs for _, r in i.leaves} | {
            self.names[r.id] for r in iter_refs(head_values)}
        idx = 0
        while idx < len(nodes):
            node = nodes[idx]
            if node.recompute is None:
                self.node_lines(idx, node, body, True)
                self.defined.update(self.names[r.id] for r in node.output_refs())
                idx += 1
                continue
            end = idx
            while end < len(nodes) and nodes[end].recompute == node.recompute:
                end += 1
            emit_recompute(self, nodes, idx, end, body)
            idx = end
        return body

    def dead_names(self, idx: int) -> List[str]:
        """Variables of values whose last use is op `idx` (not parameters or arguments)."""
        return [self.names[r] for r in self.last_use.get(idx, []) if not self.names[r].startswith("self.")
                and self.names[r] not in self.naming.arg_names]

    def node_lines(self, idx: int, node: Node, out: Lines, with_dels: bool) -> None:
        """Append op `idx` (`node`) to `out`: conversions, comment, statement, and `del`s when asked."""
        graph, adapt = self.graph, self.adapter
        src = describe_source(node)
        comment = f"# {src}" if src != self.prev_src and src else None
        self.prev_src = src or self.prev_src
        branch = branch_emit(node, adapt, graph)  # an op of one branch of a decision (codegen/branches.py)
        # conversions first: they tell the renderer the converted names
        conversions = branch.inputs() if branch else adapt.inputs(node)
        own = statement(node, adapt.renderer_for(node), graph, self.unit) + \
            rescale_sizes(node, self.unit, self.names, graph, adapt.received)
        if self.rnd is not None:  # random ops draw from the runtime's stream (codegen/random_streams.py)
            own = self.rnd.wrap(node, own, adapt.renderer_for(node))
        if self.sbn is not None:  # batch norm statistics over the data-parallel replicas
            own = self.sbn.wrap(node, own)
        own = collective_call(node, own, self.unit, adapt.ranks)  # experts / attention split over the unit (collective_ops.py)
        own = own + self.writes.lines(node, adapt)  # an in-place update of a stored tensor (codegen/state_writes.py)
        if branch is not None:
            conversions, own = branch.wrap(conversions, own)
        if node.only_when is not None:  # an op of one mode only (nnscaler.ir.tracer.modes); nothing reads its outputs
            own = [f"if {'' if node.only_when else 'not '}self.training:"] + ["    " + line for line in own]
        # the user's `with torch.no_grad():` / `with torch.autocast(...)`: consecutive ops share one
        # block; layout conversions stay outside (a later consumer may need their gradient)
        context = context_line(node)
        indent = "    " if context else ""
        inside = context is not None and not conversions and out.block_open(context)
        # consecutive ops of one branch share its `if` block (codegen/branches.py)
        header = own[0] if branch is not None and node.branch is not None and not branch.hoisted and not context \
            else None
        if header is not None and not conversions and out.block_open(header):
            own, comment = own[1:], comment and "    " + comment
        if comment:
            out.append(indent + comment if inside else comment)
        if not inside:
            out.extend(conversions)
            if context:
                out.append(context)
        source = describe_source(node, full=True) or node.target
        for line in own:
            out.append(indent + line, source)
        if header is not None:
            out.open(header)
        if node.branch is not None:
            self.conditions.update((self.names[r.id], tuple(node.branch)) for r in node.output_refs())
        if with_dels:
            dead = self.dead_names(idx)
            if dead:
                out.append(indent + "del " + ", ".join(dead))
        if context:
            out.open(context)


def last_uses(nodes: List[Node], keep: set) -> Dict[int, List[int]]:
    """node index -> value ids whose last use is that node (not those in `keep`)."""
    last: Dict[int, int] = {}
    for idx, node in enumerate(nodes):
        for r in node.input_refs():
            last[r.id] = idx
    out: Dict[int, List[int]] = {}
    for vid, idx in last.items():
        if vid not in keep:
            out.setdefault(idx, []).append(vid)
    return {k: sorted(set(v)) for k, v in out.items()}
