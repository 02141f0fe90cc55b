"""`cp`'s attention masks built on each rank's rows only.

A model that builds its attention mask itself (transformers' ``create_causal_mask`` for a padded
batch or packed documents: positions compared with positions, ``(batch, 1, L, L)``) builds it from
values no sequence split reaches (``arange``, the whole ``position_ids`` cumulated), so following
the split from the inputs would build the whole (L, L) mask on every rank and then keep its rows.
`mask_row_splits` walks back from every attention mask's rows instead: an op whose output is needed
split along an axis it can split (its annotation says so) is split along it, and its inputs are
needed split along the matching axes, until an op that cannot split (its output, small, is sliced
locally by the adapters: the row positions, a (batch, L) document index). The mask is then built
(L / N, L) on each rank, once a forward (ring attention reads it into two ints a row,
`nnscaler.runtime.ring_masks`).
"""
from __future__ import annotations

from typing import Dict

from nnscaler.ir import SDPA

from ..plan import tensor_inputs, tensor_outputs
from ._spread import splittable

__all__ = ["mask_row_splits"]


def mask_row_splits(graph, n: int) -> Dict[int, str]:
    """node id -> the annotated dim to split it along so that the attention masks' rows are built split."""
    want: Dict[int, int] = {}  # value id -> the axis it is needed split along
    for node in graph.nodes:
        if node.target == SDPA:
            for ref in tensor_inputs(graph, node)[3:4]:
                shape = graph.value(ref).shape
                if shape is not None and len(shape) >= 2 and shape[-2] != 1:
                    want[ref.id] = len(shape) - 2
    split: Dict[int, str] = {}
    for node in reversed(list(graph.nodes)):
        if node.target == SDPA:
            continue
        outs = tensor_outputs(graph, node)
        needed = [(i, want[r.id]) for i, r in enumerate(outs) if r.id in want]
        if not needed:
            continue
        bound = _bound(graph, node)
        if bound is None:
            continue
        index, axis = needed[0]
        dim = _name(bound.outputs[index], axis) if index < len(bound.outputs) else None
        if dim is None or dim not in splittable(graph, node, n):
            continue
        split[node.id] = dim
        for ref, names in zip(tensor_inputs(graph, node), bound.inputs):
            if names is None:
                continue
            for pos, name in enumerate(names):
                if _name(names, pos) == dim and graph.value(ref).shape is not None:
                    want.setdefault(ref.id, pos)
    return split


def _bound(graph, node):
    from ..primitives import bind_annotation
    return bind_annotation(graph, node)


def _name(names, axis: int):
    if names is None or not -len(names) <= axis < len(names):
        return None
    name = names[axis]
    return name[1:-1].split()[0] if name.startswith("(") else name
