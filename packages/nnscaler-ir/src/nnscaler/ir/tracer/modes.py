"""Training and eval mode in one graph.

A forward can depend on ``module.training``: ``nn.Dropout`` passes ``training=self.training`` to
``F.dropout``, ``nn.BatchNorm`` passes it to ``F.batch_norm`` and counts ``num_batches_tracked``
only when training, user code may branch on it. A single trace records one mode's constants,
so `trace` runs the forward in both modes and `annotate_modes` lines the two graphs up:

* an op whose constant arguments differ between the modes gets ``node.mode_args``
  (``[where, key, value in training, value in eval]``, ``where`` is ``"args"`` or ``"kwargs"``):
  the generated code passes ``self.training`` (or ``a if self.training else b``) there;
* an op of one mode's trace missing from the other's, in place and with no reader of its output
  (``num_batches_tracked.add_(1)``), gets ``node.only_when`` = that mode (an op of the other
  mode's trace is copied into the graph): the generated code runs it under
  ``if self.training:`` (or ``if not self.training:``);
* any other difference (a Python branch on ``self.training`` that changes which ops run) is
  recorded in ``graph.mode_divergence`` with the user's line: the generated code follows the
  traced mode only, and the runtime refuses to run in the other mode with that line in the error.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional

from ..graph import IRGraph, Node, Ref, iter_refs, map_refs

__all__ = ["annotate_modes", "mode_name"]


def mode_name(training: bool) -> str:
    return "training" if training else "eval"


def annotate_modes(graph: IRGraph, other: IRGraph, traced_training: bool) -> None:
    """Annotate `graph` (traced in mode `traced_training`) from `other`, the same forward traced in
    the other mode (see the module docstring). Changes `graph` in place."""
    _clear(graph)
    align = _Alignment(graph, other)
    problem = align.start() or align.walk(traced_training)
    if problem is not None:
        _clear(graph)
        graph.mode_divergence = problem


def _clear(graph: IRGraph) -> None:
    graph.mode_divergence = None
    for node in graph.nodes:
        node.mode_args, node.only_when = [], None


class _Alignment:
    def __init__(self, graph: IRGraph, other: IRGraph):
        self.graph, self.other = graph, other
        self.ids: Dict[int, int] = {}  # other's value id -> graph's value id

    def start(self) -> Optional[str]:
        """Map what exists before any op: parameters, buffers, inputs, captured constants."""
        g, o = self.graph, self.other
        for kind in ("params", "buffers"):
            mine, theirs = getattr(g, kind), getattr(o, kind)
            for name, spec in theirs.items():
                if name not in mine:
                    return f"the module's {kind[:-1]} {name} exists in one mode only"
                self.ids[spec.value.id] = mine[name].value.id
        for inp_o, inp_g in zip(o.inputs, g.inputs):
            for (path_o, ref_o), (path_g, ref_g) in zip(inp_o.leaves, inp_g.leaves):
                if path_o == path_g:
                    self.ids[ref_o.id] = ref_g.id
        for name, spec in o.constants.items():
            mine = g.constants.get(name)
            if mine is not None and _same_tensor(getattr(spec, "tensor", None), getattr(mine, "tensor", None)):
                self.ids[spec.value.id] = mine.value.id
        return None

    def walk(self, traced_training: bool) -> Optional[str]:
        mine, theirs = self.graph.nodes, self.other.nodes
        readers, other_readers = _last_reader(self.graph), _last_reader(self.other)
        i = j = 0
        while i < len(mine) or j < len(theirs):
            a = mine[i] if i < len(mine) else None
            b = theirs[j] if j < len(theirs) else None
            if a is not None and b is not None:
                diffs = self._match(a, b)
                if diffs is not None:
                    for where, key, ours, other_value in diffs:
                        train, eval_ = (ours, other_value) if traced_training else (other_value, ours)
                        a.mode_args.append([where, key, train, eval_])
                    for ro, rg in zip(iter_refs(b.outputs), iter_refs(a.outputs)):
                        self.ids[ro.id] = rg.id
                    i, j = i + 1, j + 1
                    continue
            if a is not None and _side_effect_only(a, i, readers):
                a.only_when = traced_training
                i += 1
                continue
            if b is not None and _side_effect_only(b, j, other_readers) and self._adopt(b, i, not traced_training):
                mine = self.graph.nodes  # b's copy now sits at index i, before a
                readers = _last_reader(self.graph)
                i, j = i + 1, j + 1
                continue
            return _describe(a, b, traced_training)
        mine_upd, their_upd = self.graph.buffer_updates, self.other.buffer_updates
        if set(mine_upd) != set(their_upd) or not all(self._same(mine_upd[k], their_upd[k]) for k in mine_upd):
            return (f"forward reassigns buffers {sorted(mine_upd)} in {mode_name(traced_training)} mode and "
                    f"{sorted(their_upd)} (or to other values) in {mode_name(not traced_training)} mode")
        if not self._same(self.graph.output, self.other.output):
            return (f"the forward returns other values in {mode_name(not traced_training)} mode than in "
                    f"{mode_name(traced_training)} mode")
        return None

    def _adopt(self, b: Node, index: int, other_training: bool) -> bool:
        """Insert a copy of the other mode's side-effect-only op `b` at `index` (it runs only in
        that mode, `other_training`); False when it reads a value this graph does not have."""
        if any(r.id not in self.ids for r in b.input_refs()):
            return False
        g = self.graph
        fresh = {}
        next_value = max(g.values, default=-1) + 1
        for r in b.output_refs():
            fresh[r.id] = next_value
            g.values[next_value] = dataclasses.replace(self.other.values[r.id], id=next_value)
            next_value += 1
        to_mine = lambda r: Ref(self.ids[r.id])  # noqa: E731
        node = Node(max((n.id for n in g.nodes), default=-1) + 1, b.target, map_refs(b.args, to_mine),
                    map_refs(b.kwargs, to_mine), map_refs(b.outputs, lambda r: Ref(fresh[r.id])), b.module_path,
                    b.source, b.annotation, b.inplace, only_when=other_training,
                    grad_enabled=b.grad_enabled, autocast=b.autocast)
        g.nodes.insert(index, node)
        return True

    def _match(self, a: Node, b: Node) -> Optional[List[list]]:
        """The constant arguments that differ (a list, maybe empty) when `a` and `b` are the same op
        on the same values; None when they are not."""
        if (a.target, a.module_path, a.inplace, a.grad_enabled, a.autocast) != \
                (b.target, b.module_path, b.inplace, b.grad_enabled, b.autocast) \
                or len(a.args) != len(b.args) or set(a.kwargs) != set(b.kwargs):
            return None
        outs_a, outs_b = list(iter_refs(a.outputs)), list(iter_refs(b.outputs))
        if len(outs_a) != len(outs_b) or any(
                _value_key(self.graph, x) != _value_key(self.other, y) for x, y in zip(outs_a, outs_b)):
            return None
        diffs = []
        pairs = [("args", k, x, y) for k, (x, y) in enumerate(zip(a.args, b.args))]
        pairs += [("kwargs", k, a.kwargs[k], b.kwargs[k]) for k in a.kwargs]
        for where, key, x, y in pairs:
            if self._same(x, y):
                continue
            if self._may_differ(x, y):
                diffs.append([where, key, x, y])
                continue
            return None
        return diffs

    def _may_differ(self, x, y) -> bool:
        """Whether arguments `x` (this graph) and `y` (the other) may differ in a matched op: here
        constants only (nnscaler.ir.tracer.branches also allows values)."""
        return _is_constant(x) and _is_constant(y)

    def _same(self, x, y) -> bool:
        if isinstance(y, Ref):
            return isinstance(x, Ref) and self.ids.get(y.id) == x.id
        if type(x) is not type(y):
            return False
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(self._same(p, q) for p, q in zip(x, y))
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(self._same(x[k], y[k]) for k in x)
        if isinstance(x, slice):
            return self._same((x.start, x.stop, x.step), (y.start, y.stop, y.step))
        if isinstance(x, float) and math.isnan(x):
            return math.isnan(y)
        return x == y


def _is_constant(obj) -> bool:
    return next(iter_refs(obj), None) is None


def _value_key(graph: IRGraph, ref: Ref):
    v = graph.values.get(ref.id)
    return None if v is None else (v.kind, v.shape, v.dtype)


def _same_tensor(x, y) -> bool:
    import torch
    if x is None or y is None:
        return x is None and y is None
    return x.shape == y.shape and x.dtype == y.dtype and bool(torch.equal(x, y))


def _last_reader(graph: IRGraph) -> Dict[int, int]:
    """value id -> index of the last node reading it (graph outputs and buffers' new values are
    read at the end)."""
    last = {}
    for idx, node in enumerate(graph.nodes):
        for r in node.input_refs():
            last[r.id] = idx
    for r in iter_refs((graph.output, graph.buffer_updates)):
        last[r.id] = len(graph.nodes)
    return last


def _side_effect_only(node: Node, idx: int, readers: Dict[int, int]) -> bool:
    """An in-place op whose outputs nothing after it reads (a counter update)."""
    return node.inplace and all(readers.get(r.id, -1) <= idx for r in node.output_refs())


def _describe(a: Optional[Node], b: Optional[Node], traced_training: bool) -> str:
    mine, theirs = mode_name(traced_training), mode_name(not traced_training)
    node = a if a is not None and a.source is not None else b
    where = f"{node.source}" if node is not None and node.source is not None else "the end of forward"
    if a is not None and b is not None and a.target == b.target:
        return f"{where} (it runs {a.target} on other arguments in {mine} mode than in {theirs} mode)"
    ran_a = a.target if a is not None else "nothing more"
    ran_b = b.target if b is not None else "nothing more"
    return f"{where} (in {mine} mode it runs {ran_a}, in {theirs} mode {ran_b})"
