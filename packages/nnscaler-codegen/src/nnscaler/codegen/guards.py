"""Guards in generated code: the Python decisions the trace took on tensor values.

A guard node (nnscaler.ir.tracer.guards) becomes one call of ``nr.guards.check`` on the tensor the
user's forward read (made whole first by the adapters: a guard is replicated, so it needs its
input replicated), with the kind of read, the value seen while tracing, the user's line and the
graph inputs the value derives from. ``agree`` makes every rank raise together (world size > 1):
always for a tensor-parallel plan, for a data-parallel-only plan when grad is enabled (a training
forward; evaluating under ``torch.no_grad()`` on one rank alone keeps working), never for a
pipelined module, which relies on its executor's failure notices.

A guard inside one branch of a decision (nnscaler.ir.tracer.branches; HF's "is the padding only in
future positions?", asked only of a padded batch) runs on every rank all the same, outside the
branch's ``if``, on ``(value if _branch_N else None)``: a rank whose data took the other branch has
nothing to check but still joins the agreement, so data-parallel ranks whose batches take different
branches run the same collectives.
"""
from __future__ import annotations

from typing import List

from nnscaler.ir import Node

from .render import Renderer
from .branches import decision_statement, decision_var


def guard_statement(node: Node, renderer: Renderer, pipelined: bool, args=None, kwargs=None,
                    plan_ngpus: int = 1) -> List[str]:
    """`args`/`kwargs`: the node's, with the values that differ between training and eval or
    between the branches of an earlier decision already substituted (ModeChoice, BranchChoice)."""
    args = node.args if args is None else args
    kwargs = dict(node.kwargs if kwargs is None else kwargs)
    if kwargs.get("branches"):  # both branches are in the program: the decision chooses
        return decision_statement(node, renderer.value(args[0]))
    at = f"{node.source}" if node.source is not None else ""
    value = renderer.value(args[0])
    if node.branch is not None:  # checked on every rank, on the branch's value or None (module docstring)
        gid, side = node.branch
        value = f"({value} if {'' if side else 'not '}{decision_var(gid)} else None)"
    parts = [value, renderer.value(kwargs.pop("read")), renderer.value(kwargs.pop("traced"))]
    kwargs.pop("skipped", None)
    decision = kwargs.pop("decision", None)
    parts.append(f"at={at!r}")
    for key in ("cause", "via"):
        if kwargs.get(key):
            parts.append(f"{key}={renderer.value(kwargs[key])}")
    if decision is not None:
        parts.append(f"decision={decision!r}")
    if pipelined:
        parts.append("agree=False")
    elif plan_ngpus > 1:
        parts.append("agree=True")
    else:  # data-parallel only: a forward under no_grad runs no collective and may run on one rank alone
        parts.append("agree=torch.is_grad_enabled()")
    return [f"nr.guards.check({', '.join(parts)})"]
