"""Stable names of ops across re-traces: ``<module path>|<op name>|<k>``, the k-th op of that
name in that module, in program order. Plans and constraints refer to ops by these keys."""
from __future__ import annotations

from typing import Dict

from nnscaler.ir import IRGraph

__all__ = ["op_keys"]


def op_keys(graph: IRGraph) -> Dict[int, str]:
    """node id -> key."""
    seen: Dict[tuple, int] = {}
    keys = {}
    for node in graph.nodes:
        k = seen.get((node.module_path, node.short_name), 0)
        seen[(node.module_path, node.short_name)] = k + 1
        keys[node.id] = f"{node.module_path}|{node.short_name}|{k}"
    return keys
