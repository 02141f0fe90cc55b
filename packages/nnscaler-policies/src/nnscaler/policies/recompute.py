"""Activation recomputation: ops marked here are recomputed in backward instead of stored.

Consecutive ops with the same mark become one checkpointed segment of the generated forward
(`torch.utils.checkpoint`, non-reentrant): their activations are dropped after forward and
recomputed, collectives included, when backward reaches them.
"""
from __future__ import annotations

import fnmatch
from typing import Iterable, List, Optional, Union

from nnscaler.ir import IRGraph, Node

from .plan import PlanError


def recompute(graph: IRGraph, nodes: Iterable[Node], group: Optional[str] = None) -> None:
    """Mark `nodes` for recomputation as one group (named `group`, default: the first op's id)."""
    nodes = list(nodes)
    if not nodes:
        return
    name = group or f"ops_{nodes[0].id}"
    for node in nodes:
        node.recompute = name


def recompute_modules(graph: IRGraph, modules: Union[str, Iterable[str]]) -> List[str]:
    """Recompute every op inside the matching modules, one group per module instance.

    `modules`: names separated by commas (as autodist's ``recompute_modules``) or a list; each is
    a module class name (``Block``), a qualified class (``gpt.Block``) or a module path glob
    (``h.*``, ``h.0.attn``). Nested matches belong to the outermost one. Returns the module paths
    recomputed; a name that matches nothing is an error naming the modules there are.
    """
    names = [m.strip() for m in (modules.split(",") if isinstance(modules, str) else modules) if m.strip()]
    matched = []
    for name in names:
        hits = [path for path, cls in graph.module_types.items() if path and (
            cls == name or cls.rsplit(".", 1)[-1] == name or fnmatch.fnmatchcase(path, name))]
        if not hits:
            kinds = sorted({c.rsplit(".", 1)[-1] for p, c in graph.module_types.items() if p})
            raise PlanError(f"recompute_modules: {name!r} matches no module of {graph.module_class}; "
                            f"module types there: {', '.join(kinds)} (or give a module path glob)")
        matched.extend(hits)
    outermost = [p for p in matched if not any(p != q and p.startswith(q + ".") for q in matched)]
    for path in sorted(set(outermost)):
        recompute(graph, (n for n in graph.nodes if n.module_path == path or n.module_path.startswith(path + ".")),
                  group=path)
    return sorted(set(outermost))
