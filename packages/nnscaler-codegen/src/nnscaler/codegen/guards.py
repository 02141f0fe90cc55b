"""Guards in generated code: the Python decisions the trace took on tensor values.

A guard node (nnscaler.ir.guards) becomes one call of ``nr.guards.check`` on the tensor the
user's forward read (made whole first by the adapters: a guard is replicated, so it needs its
input replicated), with the kind of read, the value seen while tracing, the user's line and the
graph inputs the value derives from. ``agree=True`` (world size > 1, not pipelined) makes every
rank raise together; a pipelined module relies on its executor's failure notices.
"""
from __future__ import annotations

from typing import List

from nnscaler.ir.graph import Node

from .render import ModeChoice, Renderer


def guard_statement(node: Node, renderer: Renderer, pipelined: bool) -> List[str]:
    if node.kwargs.get("branches"):  # both branches are in the program: the decision chooses
        from .branches import decision_statement
        return decision_statement(node, renderer)
    kwargs = dict(node.kwargs)
    for where, key, train, eval_ in node.mode_args:  # a value that differs between training and eval
        if where == "kwargs":
            kwargs[key] = ModeChoice(train, eval_)
    at = f"{node.source}" if node.source is not None else ""
    parts = [renderer.value(node.args[0]), renderer.value(kwargs.pop("read")), renderer.value(kwargs.pop("traced"))]
    kwargs.pop("skipped", None)
    decision = kwargs.pop("decision", None)
    parts.append(f"at={at!r}")
    for key in ("cause", "via"):
        if kwargs.get(key):
            parts.append(f"{key}={renderer.value(kwargs[key])}")
    if decision is not None:
        parts.append(f"decision={decision!r}")
    parts.append(f"agree={not pipelined!r}")
    return [f"nr.guards.check({', '.join(parts)})"]
