"""In-place writes a plan must keep together: a write, the views it writes through and their base.

DeepSeek-V3's attention fills ``key = k.new_empty(...); key[..., :8].copy_(k_nope)``. The write
changes the base through a view; anything that copies a value between them (an adapter's split or
gather, a pipeline stage's send) makes the write land in the copy, and later readers of the base
see memory nobody wrote.

- `write_groups`: the writes through views of one base, with those views and the base's op
  (`WriteGroup`); `cp` splits a group along the sequence where every op of it can follow that
  split (`builtin/_cp_writes.py`).
- `written_through_views`: the ops of such a write (the write, its views, their base), which the
  tensor-parallel policies (`tp`, `cp` where a group cannot follow the sequence) keep replicated.
- `write_spans`: per in-place op, the program-order span from the producer of the tensor it
  writes (through views) to the write; a pipeline stage boundary inside it would send the base
  before the write (or a view apart from its base), and the receiving stage would write into a
  received leaf (autograd refuses that) or a copy. `cut_stages` does not cut there, `stage`
  refuses to, and `validate_plan` refuses stages set by hand that do.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

__all__ = ["VIEW_OPS", "WriteGroup", "write_groups", "written_through_views", "write_spans"]

# Ops whose result may share its input's storage (a write into the result writes into the input).
VIEW_OPS = frozenset(f"torch.Tensor.{m}" for m in (
    "__getitem__", "view", "view_as", "reshape", "transpose", "permute", "narrow", "select", "unsqueeze",
    "squeeze", "expand", "expand_as", "t", "as_strided", "diagonal", "split", "chunk", "unbind", "flatten",
    "unflatten", "detach", "movedim")) | {"torch.reshape", "torch.transpose", "torch.narrow", "torch.split",
                                           "torch.chunk", "torch.unbind", "torch.flatten", "torch.movedim"}


@dataclass
class WriteGroup:
    """The in-place writes through views of one tensor (`root`, a value id): `base` is the op that
    produced it (None for a forward argument, parameter or buffer), `views` the view ops the writes'
    targets were made by and `writes` the writes, both in program order."""

    root: int
    base: Optional[object] = None
    views: List[object] = field(default_factory=list)
    writes: List[object] = field(default_factory=list)

    def ops(self) -> list:
        return ([self.base] if self.base is not None else []) + self.views + self.writes


def write_groups(graph) -> List[WriteGroup]:
    """One `WriteGroup` per tensor written in place through a view, in the order of their first write."""
    producers = graph.producers()
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    groups = {}
    for node in graph.nodes:
        ins = node.input_refs() if node.inplace else []
        src = producers.get(ins[0].id) if ins else None
        if src is None or src.target not in VIEW_OPS:
            continue
        chain = []
        while src is not None and src.target in VIEW_OPS:
            chain.append(src)
            root = src.input_refs()[0].id
            src = producers.get(root)
        group = groups.setdefault(root, WriteGroup(root, src))
        group.writes.append(node)
        seen = {id(v) for v in group.views}
        group.views += [v for v in chain if id(v) not in seen]
    for group in groups.values():
        group.views.sort(key=lambda v: order[id(v)])
    return list(groups.values())


def written_through_views(graph) -> set:
    """Ids of the ops of an in-place write through a view: the write, the views its target was
    made by, and their base. Split along a random dim, a view's piece is taken of a converted copy
    of the base (or only part of the base is written), so later readers of the base see memory
    nobody wrote; replicated, the write reaches the base whole."""
    return {op.id for group in write_groups(graph) for op in group.ops()}


def write_spans(graph) -> List[Tuple[int, int, object]]:
    """(first, last, write) op indices: for each in-place op (index `last`) whose target an op of the
    graph produced, directly or through views, `first` is the index of the op producing the base. A
    stage may not start at an index in ``(first, last]``. Targets nothing produced (a parameter, a
    buffer, a forward argument) give no span."""
    producers = graph.producers()
    index = {id(n): i for i, n in enumerate(graph.nodes)}
    spans = []
    for last, node in enumerate(graph.nodes):
        ins = node.input_refs() if node.inplace else []
        src = producers.get(ins[0].id) if ins else None
        first = last
        while src is not None and id(src) in index:
            first = min(first, index[id(src)])
            base = src.input_refs() if src.target in VIEW_OPS else []
            src = producers.get(base[0].id) if base else None
        if first < last:
            spans.append((first, last, node))
    return spans
