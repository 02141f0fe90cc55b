"""A recompute group in generated code: its ops as a nested function run under
``torch.utils.checkpoint`` (non-reentrant), so backward recomputes them instead of keeping their
activations.

The function's parameters are its free variables, taken from the graph: the variables through
which its ops read values made before it (each input's own variable, or the variable of a layout
conversion made before the segment and reused inside it). Its results are the values it makes
that later ops (or the body's outputs) read. Conversions made inside the segment stay local to
it: later consumers convert again.

Both branches of a decision (codegen/branches.py): a variable assigned on one branch only (Hugging
Face's attention mask, made only when the batch is padded) is unbound on the other, so the call
passes it, and the function returns it, as ``(x if _branch_N else None)``: inside, only that branch
reads it. A decision taken inside the segment that later ops (or later pipeline stages) test is
returned as well.
"""
from __future__ import annotations

from typing import Dict, List, Protocol, Tuple

from nnscaler.ir import Node, is_guard, iter_refs

from .branches import decision_var, decisions_tested
from .conversions import Adapter
from .lines import Lines
from .naming import Naming
from .render import python_name

__all__ = ["emit_recompute", "read_refs"]


class BodyState(Protocol):
    """What a recompute group reads and updates of the body it is emitted in (body.BodyEmitter)."""

    names: Dict[int, str]
    naming: Naming
    adapter: Adapter
    keep: set
    defined: set
    last_use: Dict[int, List[int]]
    conditions: Dict[str, Tuple[int, bool]]
    decisions_out: set  # decisions the body returns (a pipeline stage sends them on)

    def node_lines(self, idx: int, node: Node, out: Lines, with_dels: bool) -> None: ...


def read_refs(node: Node) -> list:
    """The values an op's generated statement may read: its inputs and its branch arguments."""
    return node.input_refs() + list(iter_refs([(t, f) for _, _, _, t, f in node.branch_args]))


def _bound(name: str, conditions: Dict[str, Tuple[int, bool]]) -> str:
    """`name`, or ``(name if [not ]_branch_N else None)`` when only one branch assigns it."""
    if name not in conditions:
        return name
    gid, side = conditions[name]
    return f"({name} if {'' if side else 'not '}{decision_var(gid)} else None)"


def emit_recompute(ctx: BodyState, nodes: List[Node], start: int, end: int, body: Lines) -> None:
    """Append ops ``nodes[start:end]`` (one recompute group) to `body` as a checkpointed function."""
    names, adapt = ctx.names, ctx.adapter
    group = nodes[start].recompute
    converted_before = dict(adapt.converted)
    outer = set(ctx.defined) | set(converted_before.values())  # what the enclosing body defined
    inner = Lines()
    reads: set = set()
    for i in range(start, end):
        adapt.reads = set()
        ctx.node_lines(i, nodes[i], inner, False)
        reads |= adapt.reads | {adapt.read_name(r.id) for r in read_refs(nodes[i])}
    seg_ids = {r.id for n in nodes[start:end] for r in n.output_refs()}
    later = {r.id for n in nodes[end:] for r in n.input_refs()} | ctx.keep
    outputs = [names[v] for v in sorted(seg_ids & later)]
    tested_later = set().union(ctx.decisions_out, *(decisions_tested(n) for n in nodes[end:]))
    outputs += [decision_var(n.id) for n in nodes[start:end]
                if is_guard(n) and n.kwargs.get("branches") and n.id in tested_later]
    args = sorted(reads & outer)
    adapt.converted = converted_before  # conversions made inside the segment are local to it
    fn = python_name(f"_recompute_{group}", ctx.naming.taken)
    body.append(f"# recomputed in backward: {group}")
    body.append(f"def {fn}({', '.join(args)}):")
    body.nest(inner)
    cond = ctx.conditions
    ret = ", ".join(_bound(o, cond) for o in outputs) + ("," if len(outputs) == 1 else "")
    body.append(f"    return ({ret})")
    lhs = "(" + ", ".join(outputs) + ("," if len(outputs) == 1 else "") + ")" if outputs else "_"
    passed = [_bound(a, cond) for a in args]
    body.append(f"{lhs} = torch.utils.checkpoint.checkpoint({fn}, {', '.join(passed)}{', ' if args else ''}"
                f"use_reentrant=False)")
    ctx.defined.update(outputs)
    dead = sorted({names[r] for i in range(start, end) for r in ctx.last_use.get(i, [])
                   if names[r] in outer and not names[r].startswith("self.") and names[r] not in ctx.naming.arg_names})
    if dead:
        body.append("del " + ", ".join(dead))
