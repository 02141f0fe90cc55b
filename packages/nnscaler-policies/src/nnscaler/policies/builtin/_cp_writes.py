"""`cp`'s in-place writes through views: split along the sequence where every op of the write can follow it.

DeepSeek-V3's attention fills its key in place: ``key = kv.new_empty(b, h, s, 16); key[..., :8].copy_(k_nope);
key[..., 8:].copy_(k_rot)``. Such a group (`inplace_writes.WriteGroup`: the base's op, the views the writes
go through, the writes) is split along the sequence when each rank's write then lands in its own rows of
its own piece of the base, which holds what the rows of the whole base hold:

- the base is fresh memory: a ``new_empty`` / ``new_zeros`` / ``new_ones`` with exactly one size traced
  from the sequence axis of a value split along it (codegen gives the piece its local size);
- each view splits the axis its input is split along (it slices, selects or permutes other dims only)
  and always returns a view (not ``reshape`` / ``flatten``, which may copy), reading no other tensor;
- each write splits its target's axis, its result aliasing the target; its other inputs (the written
  values) are no view of the base, and arrive as the adapters make them (a slice or an exchange: exact);
- no other op reads the base or a view before the last write (a conversion made then would be reused
  after the write, stale), shape reads excepted, and no other op writes into them in place (replicated,
  it would write into a gathered copy).

Otherwise the group stays whole on every device (`written_through_views`, exact: its written values
gathered, attention then takes its rows).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

from nnscaler.ir import Replicate, Shard

from ..inplace_writes import write_groups
from ..plan import Piece, tensor_inputs, tensor_outputs
from ._spread import dim_of_input_axis, splittable
from ..primitives import bind_annotation

__all__ = ["SequenceWrites", "FACTORIES", "ALWAYS_VIEWS"]

# Tensor methods whose arguments after the tensor are the output's sizes (codegen localizes them).
FACTORIES = frozenset(f"torch.Tensor.{m}" for m in ("new_empty", "new_zeros", "new_ones"))
# View ops whose result is a view of their input whatever its strides (a local piece's included).
ALWAYS_VIEWS = frozenset(f"torch.Tensor.{m}" for m in (
    "__getitem__", "view", "transpose", "permute", "narrow", "select", "unsqueeze", "squeeze", "expand", "t",
    "diagonal", "split", "chunk", "unbind", "detach", "movedim")) | {
    "torch.transpose", "torch.narrow", "torch.split", "torch.chunk", "torch.unbind", "torch.movedim"}
_SHAPE_READS = ("torch.Tensor.size", "torch.Tensor.numel")

Placed = Tuple[list, list, str]  # input placements, output placements, the piece's dim


class SequenceWrites:
    """The write groups of `graph`; `split` decides a group when `cp` reaches its first op."""

    def __init__(self, graph):
        self.graph = graph
        self.groups = {op.id: g for g in write_groups(graph) for op in g.ops()}
        self.plans: Dict[int, Optional[Dict[int, Placed]]] = {}  # group root -> op id -> placements
        self._order = {id(n): i for i, n in enumerate(graph.nodes)}

    def __contains__(self, node_id: int) -> bool:
        return node_id in self.groups

    def split(self, node, along: Dict[int, int], devices: Sequence[int]) -> bool:
        """Give `node` (an op of a write group) its pieces along the sequence over `devices` when its
        group can follow the split (`along`: value id -> its split axis); False when it stays whole."""
        group = self.groups[node.id]
        if group.root not in self.plans:
            self.plans[group.root] = self._plan(group, along, len(devices))
        plan = self.plans[group.root]
        if plan is None:
            return False
        ins, outs, dim = plan[node.id]
        node.pieces = [Piece(i, len(devices), list(ins), list(outs), dim, d) for i, d in enumerate(devices)]
        return True

    def _plan(self, group, along, n) -> Optional[Dict[int, Placed]]:
        graph = self.graph
        if group.base is None:
            return None
        base = self._placed_base(group.base, group.root, along, n)
        if base is None:
            return None
        plan = {group.base.id: base}
        aliased = {r.id: p.dim for r, p in zip(tensor_outputs(graph, group.base), base[1]) if r.id == group.root}
        is_view = {id(v) for v in group.views}
        for op in sorted(group.views + group.writes, key=lambda o: self._order[id(o)]):
            ins = tensor_inputs(graph, op)
            if not ins or ins[0].id not in aliased or any(r.id in aliased for r in ins[1:]):
                return None
            if id(op) in is_view and (op.target not in ALWAYS_VIEWS or len(ins) > 1):
                return None
            axis = aliased[ins[0].id]
            placed = _follow(graph, op, axis, n)
            if placed is None or placed[0][0] != Shard(axis) or not all(isinstance(p, Shard) for p in placed[1]):
                return None
            outs = tensor_outputs(graph, op)
            if id(op) not in is_view and placed[1][:1] != [Shard(axis)]:
                return None  # the write's result is its target
            aliased.update((r.id, p.dim) for r, p in zip(outs, placed[1]))
            plan[op.id] = placed
        last = max(self._order[id(w)] for w in group.writes)
        members = {id(op) for op in group.ops()}
        for node in graph.nodes:
            reads = [r.id in aliased for r in node.input_refs()]
            if id(node) in members or not any(reads) or _shape_read(node):
                continue
            if self._order[id(node)] < last or (node.inplace and reads[0]):
                return None
        return plan

    def _placed_base(self, node, root: int, along, n) -> Optional[Placed]:
        """The base's placements split along the sequence, or None when it cannot be."""
        if node.target not in FACTORIES:
            return None
        axis = _sequence_size(self.graph, node, along)
        shape = self.graph.values[root].shape
        if axis is None or shape is None or shape[axis] % n:
            return None
        ins = [Shard(along[r.id]) if r.id in along else Replicate() for r in tensor_inputs(self.graph, node)]
        return ins, [Shard(axis)], f"d{axis}"


def _follow(graph, node, axis: int, n: int) -> Optional[Placed]:
    """`node` split along the annotated dim at `axis` of its first tensor input (None if it cannot)."""
    dim = dim_of_input_axis(graph, node, 0, axis)
    if dim is None or dim not in splittable(graph, node, n):
        return None
    ins, outs = bind_annotation(graph, node).partition(dim, n)
    return ins, outs, dim


def _sequence_size(graph, node, along) -> Optional[int]:
    """The one output axis of factory `node` whose size argument is the size of a split value along its
    split axis (read as ``x.shape[axis]`` or ``x.size(axis)``); None when there is not exactly one."""
    sizes = list(node.args[1:])
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = list(sizes[0])
    producers = graph.producers()
    hits = []
    for at, size in enumerate(sizes):
        src = producers.get(getattr(size, "id", None))
        if src is None or not src.args or not hasattr(src.args[0], "id") or src.args[0].id not in along:
            continue
        if src.target == "getattr" and list(src.args[1:]) == ["shape"] and isinstance(src.outputs, (tuple, list)):
            read = next((j for j, r in enumerate(src.outputs) if getattr(r, "id", None) == size.id), None)
        elif src.target == "torch.Tensor.size" and len(src.args) > 1 and isinstance(src.args[1], int):
            read = src.args[1]
        else:
            continue
        ndim = len(graph.value(src.args[0]).shape)
        if read is not None and read % ndim == along[src.args[0].id] % ndim:
            hits.append(at)
    return hits[0] if len(hits) == 1 else None


def _shape_read(node) -> bool:
    return node.target in _SHAPE_READS or (node.target == "getattr" and list(node.args[1:]) == ["shape"])
