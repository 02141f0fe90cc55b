"""Repeated layers: the ops of layer k of a module list mapped onto layer 0's, so the solver
decides one layer and every copy follows (search time independent of depth).

Layers are the children of a module list (a path segment that is an integer: ``h.0``,
``model.layers.3``). Two layers are copies when their ops match one to one: same target,
annotation, choices, module path below the layer and tensor shapes. Layers that do not match
layer 0 of their list are left untied.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .cost_model import Problem

__all__ = ["tie_layers"]


def _layer_of(path: str) -> Optional[Tuple[str, int, str]]:
    """(list path, layer index, path inside the layer) of the outermost integer segment."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1:])
    return None


def _signature(problem: Problem, i: int, inner: str) -> tuple:
    op = problem.ops[i]
    node = op.node
    return (node.target, node.annotation, inner, tuple(op.labels), node.recompute is not None)


def tie_layers(problem: Problem) -> Dict[int, int]:
    """op index -> representative op index (itself when untied)."""
    groups: Dict[str, Dict[int, List[int]]] = {}
    inner_of: Dict[int, str] = {}
    for i, op in enumerate(problem.ops):
        where = _layer_of(op.node.module_path)
        if where is None:
            continue
        lst, k, inner = where
        groups.setdefault(lst, {}).setdefault(k, []).append(i)
        inner_of[i] = inner
    rep = {i: i for i in range(len(problem.ops))}
    for lst, layers in groups.items():
        if len(layers) < 2:
            continue
        first = min(layers)
        base = layers[first]
        base_sig = [_signature(problem, i, inner_of[i]) + (_shapes(problem, i),) for i in base]
        for k, members in layers.items():
            if k == first or len(members) != len(base):
                continue
            sig = [_signature(problem, i, inner_of[i]) + (_shapes(problem, i),) for i in members]
            if sig != base_sig:
                continue
            for i, j in zip(members, base):
                rep[i] = j
    return rep


def _shapes(problem: Problem, i: int) -> tuple:
    op = problem.ops[i]
    return tuple(round(t, 12) for t in op.compute) + tuple(op.mem)
