"""Both branches of a Python decision on a tensor value, in one graph.

A forward that decides in Python on a tensor's value (``if mask.all():``; Hugging Face's
``padding_mask is None or fast_all(padding_mask)``) is traced one way. For a boolean decision the
tracer can take the other way too: `trace` re-runs the forward with that one decision flipped
(the tracer controls what ``Tensor.__bool__`` returns) and `merge_branches` lines the two op
lists up (the aligner of nnscaler.ir.tracer.modes, generalised):

* the ops before the decision are the same;
* after it, ops present in one trace only run under ``if <decision>:`` / ``if not <decision>:``
  (``node.branch``; the other trace's ops are copied in);
* an op present in both whose arguments differ gets ``node.branch_args``: the generated code
  passes ``(a if <decision> else b)``; one side may be a value computed in that branch only
  (SDPA's ``attn_mask=mask`` against ``attn_mask=None, is_causal=True``);
* the decision's guard becomes the decision itself (``guard.kwargs["branches"] = True``).

When the traces cannot be lined up that way (the other branch fails to run on the example,
returns other values, reads a value the graph does not have, differs inside a nested argument,
or overlaps a branch merged before) the decision stays a guard (nnscaler.ir.tracer.guards). At most
`MAX_FLIPS` decisions per forward are re-traced (each costs one more forward at trace time);
later decisions, and decisions inside a merged branch, are guarded only.

Limits: ops of the other branch carry the traced mode's constants (a Dropout only in the other
branch keeps ``training`` of the traced mode). A pipelined plan keeps both branches too: codegen
sends the decision from the stage that takes it to the later stages that test it
(nnscaler.codegen.stages).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

from ..graph import IRGraph, Node, Ref, iter_refs, map_refs
from .guards import is_guard
from .modes import _Alignment, _is_constant

MAX_FLIPS = 4  # decisions re-traced per forward; later ones are guarded only
_MAX_CELLS = 4_000_000  # alignment table size beyond which a decision is guarded only

__all__ = ["MAX_FLIPS", "merge_branches", "keep_traced_branch", "branch_refs"]


def decisions_of(graph: IRGraph) -> List[Node]:
    return [n for n in graph.nodes if is_guard(n) and n.kwargs.get("read") == "bool" and "decision" in n.kwargs]


def merge_branches(graph: IRGraph, retrace: Callable[[set], IRGraph]) -> int:
    """Merge the other branch of (up to MAX_FLIPS re-traces) boolean decisions into `graph`;
    `retrace(flips)` traces the forward with the decisions numbered in `flips` flipped. Returns how
    many decisions were merged.

    In the flipped trace the example data still belongs to the traced side, so a later decision on
    the same forward argument that only the other branch takes (Hugging Face: "is the padding only
    in future positions?") usually answers like the traced side. Those decisions are flipped too,
    one more re-trace each, as long as the result still lines up: the data that takes the other
    branch of the first decision (a padded batch) usually takes theirs as well. Their guards check
    it at run time either way."""
    plans, tried = [], 0
    next_value = max(graph.values, default=-1) + 1
    inside = set()  # ops of a branch merged before: their decisions stay guards (no re-trace)
    for guard in decisions_of(graph):
        if guard.id in inside:
            continue
        if tried >= MAX_FLIPS:
            guard.kwargs["skipped"] = f"more than {MAX_FLIPS} decisions in one forward"
            continue
        flips, best = {guard.kwargs["decision"]}, None
        while tried < MAX_FLIPS:
            tried += 1
            try:
                other = retrace(flips)
            except Exception:  # noqa: BLE001 - that branch cannot run on this example
                break
            merge = _Merge(graph, other, guard, next_value)
            try:
                plan = merge.plan()
            except Exception:  # noqa: BLE001 - traces we cannot line up: the guard is the safe answer
                plan = None
            next_value = merge.next_value
            if plan is None:
                break
            best = plan
            follow = [d for d in plan.other_decisions if d[1] == guard.kwargs.get("cause") and d[0] not in flips]
            if not follow:
                break
            flips = flips | {follow[0][0]}
        if best is not None:
            plans.append(best)
            inside |= {n.id for n in best.only_traced}
    merged = 0
    for plan in plans:
        if plan.fits(graph):
            plan.apply(graph)
            merged += 1
    return merged


def branch_refs(graph: IRGraph) -> set:
    """Ids of the values read through branch arguments (generated code must keep them alive)."""
    return {r.id for n in graph.nodes for entry in n.branch_args for r in iter_refs(entry[3:])}


def keep_traced_branch(graph: IRGraph) -> None:
    """Undo the merges: keep the ops and arguments of the traced branch (the decision becomes a
    guard again), as ``trace(..., both_branches=False)`` would have traced it. A graph a policy has
    placed is refused: an op's input placements count both branches' arguments."""
    placed = next((n for n in graph.nodes if n.branch_args and n.pieces), None)
    if placed is not None:  # dropping a branch argument would leave its placement behind
        raise ValueError(f"keep_traced_branch runs before the policy: op {placed.describe()} already has the "
                         f"placements of its inputs, both branches' arguments included; call it on the traced "
                         f"graph, then apply the policy")
    guards = {n.id: n for n in graph.nodes if is_guard(n)}
    kept = []
    for node in graph.nodes:
        if node.branch is not None and node.branch[1] != guards[node.branch[0]].kwargs["traced"]:
            continue
        node.branch = None
        if node.branch_args:
            args, kwargs = list(node.args), dict(node.kwargs)
            for where, key, gid, when_true, when_false in node.branch_args:
                traced = guards[gid].kwargs["traced"]
                (args if where == "args" else kwargs)[key] = when_true if traced else when_false
            node.args, node.kwargs, node.branch_args = args, kwargs, []
        if is_guard(node):
            node.kwargs.pop("branches", None)
        kept.append(node)
    graph.nodes = kept


@dataclasses.dataclass
class _Plan:
    guard: Node
    only_traced: List[Node]  # ops of the traced branch only
    only_other: List[tuple]  # (op to insert before or None: the end, new op, {value id: Value}, after the decision)
    diffs: Dict[int, tuple]  # node id -> (node, diffs [[where, key, traced side, other side]], other node or None)
    other_decisions: List[tuple] = dataclasses.field(default_factory=list)  # (number, cause) in the other branch

    def fits(self, graph: IRGraph) -> bool:
        """Does not overlap a merge applied before (nested or shared branches stay guarded)."""
        touched = [n for n in self.only_traced] + [d[0] for d in self.diffs.values()] + [self.guard]
        anchors = [e[0] for e in self.only_other if e[0] is not None]
        return all(n.branch is None and not n.branch_args for n in touched + anchors) and \
            all(any(n is a for n in graph.nodes) for a in anchors)

    def apply(self, graph: IRGraph) -> None:
        traced = self.guard.kwargs["traced"]
        gid = self.guard.id
        for node in self.only_traced:
            node.branch = [gid, traced]
        for node, diffs, other_node in self.diffs.values():
            if other_node is not None:  # the other branch's op has the values (the mask): it is the base
                node.args, node.kwargs, node.annotation = other_node
                diffs = [[w, k, y, x] for w, k, x, y in diffs]
                base_is_traced = False
            else:
                base_is_traced = True
            for where, key, base, alt in diffs:
                mine, theirs = (base, alt) if base_is_traced else (alt, base)
                when_true, when_false = (mine, theirs) if traced else (theirs, mine)
                node.branch_args.append([where, key, gid, when_true, when_false])
        next_id = max((n.id for n in graph.nodes), default=-1) + 1
        for anchor, node, values, conditional in self.only_other:
            graph.values.update(values)
            node.id, next_id = next_id, next_id + 1
            node.branch = [gid, not traced] if conditional else None
            graph.nodes.insert(_position(graph.nodes, anchor), node)
        self.guard.kwargs["branches"] = True


class _Merge(_Alignment):
    """Lines up the traced graph with the trace where one decision was flipped."""

    def __init__(self, graph: IRGraph, other: IRGraph, guard: Node, next_value: int):
        super().__init__(graph, other)
        self.guard = guard
        self.next_value = next_value
        self._shapes = None  # (graph's, other's) repeated shape reads: _repeated_shape_reads

    def _same(self, x, y) -> bool:
        """As the modes aligner, and a shape read is the same value as an earlier read of the same
        tensor's shape: one trace may keep a read the other dropped as dead code, so the longest
        common subsequence pairs a reader's shape with the other trace's earlier read (HF's
        ``position_ids.expand(inputs_embeds.shape[0], -1)`` before the packed-sequence decision)."""
        if not (isinstance(x, Ref) and isinstance(y, Ref)) or self.ids.get(y.id) == x.id:
            return super()._same(x, y)
        if self._shapes is None:
            self._shapes = (_repeated_shape_reads(self.graph), _repeated_shape_reads(self.other))
        mine, theirs = self._shapes
        mapped = self.ids.get(theirs.get(y.id, y.id))
        return mapped is not None and mine.get(mapped, mapped) == mine.get(x.id, x.id)

    def _may_differ(self, x, y) -> bool:
        # a constant or one value on each side (either may exist in one branch only); y is the other's
        simple = lambda v: _is_constant(v) or isinstance(v, Ref)  # noqa: E731
        return simple(x) and simple(y) and all(r.id in self.ids for r in iter_refs(y))

    def plan(self) -> Optional[_Plan]:
        if self.start() is not None:
            return None
        mine, theirs = self.graph.nodes, self.other.nodes
        at = next(k for k, n in enumerate(mine) if n is self.guard)
        pairs = _lcs(mine, theirs)
        if pairs is None:
            return None
        # Ops before the decision that one trace keeps and the other dropped as dead code do not
        # depend on the decision: they run unconditionally, where they are (pure ops only).
        only_traced, only_other, diffs = [], [], {}
        ia = ib = 0
        paired_guard = False

        def other_only(b: Node, anchor_index: int) -> bool:
            copy = self._copy(b)
            if copy is None or (b.inplace and anchor_index <= at):
                return False
            anchor = mine[anchor_index] if anchor_index < len(mine) else None
            only_other.append((anchor, copy[0], copy[1], anchor_index > at))
            return True

        for pa, pb in pairs + [(len(mine), len(theirs))]:
            for a in mine[ia:pa]:
                if a.inplace and pa <= at:
                    return None
                if pa > at:
                    only_traced.append(a)
            for b in theirs[ib:pb]:
                if not other_only(b, pa):
                    return None
            if pa == len(mine):
                break
            a, b = mine[pa], theirs[pb]
            found = self._match(a, b)
            if a is self.guard:  # the flipped trace followed the other value
                if b.kwargs.get("decision") != a.kwargs.get("decision") or \
                        any(d[:2] != ["kwargs", "traced"] for d in found or [[None]]):
                    return None
                found = []
                paired_guard = True
            if found is None:  # same place, other op: one in each branch
                if pa <= at:
                    return None
                only_traced.append(a)
                if not other_only(b, pa + 1):
                    return None
            else:
                self._pair(a, b)
                if found:
                    if pa <= at:
                        return None
                    entry = self._diff_entry(a, b, found)
                    if entry is None:
                        return None
                    diffs[a.id] = entry
            ia, ib = pa + 1, pb + 1
        if not paired_guard:
            return None
        if not (self._same(self.graph.output, self.other.output)
                and set(self.graph.buffer_updates) == set(self.other.buffer_updates)
                and all(self._same(v, self.other.buffer_updates[k]) for k, v in self.graph.buffer_updates.items())):
            return None
        if not only_traced and not only_other and not diffs:
            return None  # the other branch runs the same ops: the guard alone is right
        others = [(b.kwargs["decision"], b.kwargs.get("cause")) for b in self.other.nodes
                  if is_guard(b) and "decision" in b.kwargs and b.kwargs["decision"] > self.guard.kwargs["decision"]
                  and any(n.kwargs.get("cause") == b.kwargs.get("cause") and n.source == b.source
                          for _, n, _, cond in only_other if cond and is_guard(n))]
        return _Plan(self.guard, only_traced, only_other, diffs, others)

    def _pair(self, a: Node, b: Node) -> None:
        for ro, rg in zip(iter_refs(b.outputs), iter_refs(a.outputs)):
            self.ids[ro.id] = rg.id

    def _copy(self, b: Node):
        """The other trace's op with this graph's value ids (fresh ids for its outputs)."""
        if any(r.id not in self.ids for r in b.input_refs()):
            return None
        values = {}
        for r in b.output_refs():
            self.ids[r.id] = self.next_value
            values[self.next_value] = dataclasses.replace(self.other.values[r.id], id=self.next_value)
            self.next_value += 1
        to_mine = lambda r: Ref(self.ids[r.id])  # noqa: E731
        kwargs = map_refs(b.kwargs, to_mine)
        if is_guard(b):
            kwargs.pop("decision", None)  # a decision inside the other branch: guarded only
        node = Node(-1, b.target, map_refs(b.args, to_mine), kwargs, map_refs(b.outputs, to_mine),
                    b.module_path, b.source, b.annotation, b.inplace, grad_enabled=b.grad_enabled,
                    autocast=b.autocast)
        return node, values

    def _diff_entry(self, a: Node, b: Node, found: list):
        """(node, [[where, key, this graph's value, the other's value]], base) where base is the other
        op's (args, kwargs, annotation) when its side has the tensors (a value against a constant)."""
        to_mine = lambda r: Ref(self.ids[r.id])  # noqa: E731
        diffs = [[w, k, x, map_refs(y, to_mine)] for w, k, x, y in found]
        ours = any(isinstance(x, Ref) and not isinstance(y, Ref) for _, _, x, y in diffs)
        theirs = any(isinstance(y, Ref) and not isinstance(x, Ref) for _, _, x, y in diffs)
        if ours and theirs:
            return None  # each side has a value the other lacks: no single layout plan
        if not theirs:
            return a, diffs, None
        base = (map_refs(b.args, to_mine), map_refs(b.kwargs, to_mine), b.annotation)
        return a, diffs, base


def _repeated_shape_reads(graph: IRGraph) -> Dict[int, int]:
    """Value id of each int of a repeated ``t.shape`` -> the same int of the first read of `t`'s shape
    (tensors that an in-place op touches are left out: their shape may change)."""
    touched = {r.id for n in graph.nodes if n.inplace for r in n.input_refs()}
    first: Dict[int, Node] = {}
    out: Dict[int, int] = {}
    for n in graph.nodes:
        if n.target != "getattr" or len(n.args) != 2 or n.args[1] != "shape" or not isinstance(n.args[0], Ref) \
                or n.args[0].id in touched:
            continue
        earlier = first.setdefault(n.args[0].id, n)
        if earlier is not n:
            out.update((a.id, b.id) for a, b in zip(iter_refs(n.outputs), iter_refs(earlier.outputs)))
    return out


def _lcs(a: List[Node], b: List[Node]) -> Optional[List[tuple]]:
    """Index pairs of a longest common subsequence of op signatures (the common head and tail are
    trimmed first, so the table covers the part where the traces differ)."""
    sa = [_sig(n) for n in a]
    sb = [_sig(n) for n in b]
    head = 0
    while head < len(sa) and head < len(sb) and sa[head] == sb[head]:
        head += 1
    tail = 0
    while tail < len(sa) - head and tail < len(sb) - head and sa[-1 - tail] == sb[-1 - tail]:
        tail += 1
    ma, mb = sa[head:len(sa) - tail], sb[head:len(sb) - tail]
    n, m = len(ma), len(mb)
    if n * m > _MAX_CELLS:
        return None
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        row, below = table[i], table[i + 1]
        for j in range(m - 1, -1, -1):
            row[j] = below[j + 1] + 1 if ma[i] == mb[j] else max(below[j], row[j + 1])
    pairs, i, j = [(k, k) for k in range(head)], 0, 0
    while i < n and j < m:
        if ma[i] == mb[j]:
            pairs.append((head + i, head + j))
            i, j = i + 1, j + 1
        elif table[i + 1][j] >= table[i][j + 1]:
            i += 1
        else:
            j += 1
    pairs += [(head + n + k, head + m + k) for k in range(tail)]
    return pairs


def _sig(node: Node):
    src = (node.source.file, node.source.line) if node.source is not None else None
    return node.target, node.module_path, src


def _position(nodes: List[Node], anchor: Optional[Node]) -> int:
    return len(nodes) if anchor is None else next(i for i, n in enumerate(nodes) if n is anchor)
