"""In-place writes a plan must keep together: a write, the views it writes through and their base.

DeepSeek-V3's attention fills ``key = k.new_empty(...); key[..., :8].copy_(k_nope)``. The write
changes the base through a view; anything that copies a value between them (an adapter's split or
gather, a pipeline stage's send) makes the write land in the copy, and later readers of the base
see memory nobody wrote.

- `written_through_views`: the ops of such a write (the write, its views, their base), which the
  tensor-parallel policies (`tp`, `cp`) keep replicated.
- `write_spans`: per in-place op, the program-order span from the producer of the tensor it
  writes (through views) to the write; a pipeline stage boundary inside it would send the base
  before the write (or a view apart from its base), and the receiving stage would write into a
  received leaf (autograd refuses that) or a copy. `cut_stages` does not cut there, `stage`
  refuses to, and `validate_plan` refuses stages set by hand that do.
"""
from __future__ import annotations

from typing import List, Tuple

__all__ = ["VIEW_OPS", "written_through_views", "write_spans"]

# Ops whose result may share its input's storage (a write into the result writes into the input).
VIEW_OPS = frozenset(f"torch.Tensor.{m}" for m in (
    "__getitem__", "view", "view_as", "reshape", "transpose", "permute", "narrow", "select", "unsqueeze",
    "squeeze", "expand", "expand_as", "t", "as_strided", "diagonal", "split", "chunk", "unbind", "flatten",
    "unflatten", "detach", "movedim")) | {"torch.reshape", "torch.transpose", "torch.narrow", "torch.split",
                                           "torch.chunk", "torch.unbind", "torch.flatten", "torch.movedim"}


def written_through_views(graph) -> set:
    """Ids of the ops of an in-place write through a view: the write, the views its target was
    made by, and their base. Split along a random dim, a view's piece is taken of a converted copy
    of the base (or only part of the base is written), so later readers of the base see memory
    nobody wrote; replicated, the write reaches the base whole."""
    producers = graph.producers()
    out = set()
    for node in graph.nodes:
        ins = node.input_refs() if node.inplace else []
        src = producers.get(ins[0].id) if ins else None
        if src is None or src.target not in VIEW_OPS:
            continue
        out.add(node.id)
        while src is not None:
            out.add(src.id)
            base = src.input_refs() if src.target in VIEW_OPS else []
            src = producers.get(base[0].id) if base else None
    return out


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
