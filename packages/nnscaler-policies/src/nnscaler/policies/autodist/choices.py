"""The partition choices of each op: replicate it, or split it along one annotated dim (and, for
a routed-experts op, split its experts: expert parallelism, `EXPERT_DIM`; for attention, split
its sequence as ring attention, `RING_DIM`).

Codegen runs every op on all devices of the unit (or of its pipeline stage): either whole on
each (replicated) or as `n` pieces, piece i on device i. So an op's choices are ``R`` and each
annotated dim that splits evenly into `n`; a choice fixes the placement of every tensor input
and output (`nnscaler.ir.layout`), which is what the cost model prices.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from nnscaler.ir import EXPERT_DIM, RING_DIM, ROUTED_EXPERTS, SDPA, IRGraph, Node, Replicate, Shard

from ..plan import tensor_inputs, tensor_outputs
from ..primitives import bind_annotation

__all__ = ["Choice", "node_choices", "is_shape_query", "REPLICATE"]

REPLICATE = "R"


@dataclass(frozen=True)
class Choice:
    """One way to run an op: `dim` None is replicated; else split along annotated dim `dim`."""

    dim: Optional[str]
    ins: Tuple[object, ...]
    outs: Tuple[object, ...]

    @property
    def label(self) -> str:
        return REPLICATE if self.dim is None else self.dim

    @property
    def partitioned(self) -> bool:
        return self.dim is not None


def is_shape_query(node: Node) -> bool:
    """size() / numel() / .shape read only a shape: any layout serves them (codegen rescales)."""
    return node.target in ("torch.Tensor.size", "torch.Tensor.numel") or (
        node.target == "getattr" and list(node.args[1:]) == ["shape"])


def node_choices(graph: IRGraph, node: Node, n: int, allowed: Optional[Sequence[str]] = None) -> List[Choice]:
    """The choices of `node` on `n` devices, restricted to labels in `allowed` when given
    (``"R"`` and dim names). Replication is always possible and comes first."""
    n_in, n_out = len(tensor_inputs(graph, node)), len(tensor_outputs(graph, node))
    out = [Choice(None, (Replicate(),) * n_in, (Replicate(),) * n_out)]
    if n > 1 and not is_shape_query(node):
        bound = bind_annotation(graph, node)
        if bound is not None:
            for dim in bound.splittable_dims(n):
                ins, outs = bound.partition(dim, n)
                out.append(Choice(dim, tuple(ins), tuple(outs)))
        if node.target == ROUTED_EXPERTS and expert_parallel_fits(graph, node, n):
            out.append(Choice(EXPERT_DIM, (Shard(0),) * n_in, (Shard(0),) * n_out))  # builtin/ep.py
        if node.target == SDPA and ring_fits(graph, node, n):
            out.append(_ring_choice(graph, node))  # builtin/cp.py
    if allowed is not None:
        out = [c for c in out if c.label in allowed]
    return out


def ring_fits(graph: IRGraph, node: Node, n: int) -> bool:
    """Attention whose sequence splits into n (2n when causal) chunks, without dropout (ring attention)."""
    q = graph.value(tensor_inputs(graph, node)[0]).shape
    causal = node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)
    dropout = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
    return q is not None and len(q) == 4 and not dropout and q[-2] % (2 * n if causal else n) == 0


def _ring_choice(graph: IRGraph, node: Node) -> Choice:
    ins = tensor_inputs(graph, node)
    places = [Shard(2)] * 3 + [Shard(len(graph.value(r).shape) - 2) if graph.value(r).shape[-2:-1] not in ((), (1,))
                               else Replicate() for r in ins[3:]]
    return Choice(RING_DIM, tuple(places), (Shard(2),) * len(tensor_outputs(graph, node)))


def expert_parallel_fits(graph: IRGraph, node: Node, n: int) -> bool:
    """A routed-experts op whose experts and tokens split evenly over `n` (expert parallelism)."""
    ins = tensor_inputs(graph, node)
    tokens, k = graph.value(ins[1]).shape
    experts = graph.value(ins[3]).shape[0]
    return experts % n == 0 and tokens % n == 0 and k <= experts


def matches_module(node: Node, module_types: Dict[str, str], pattern: str) -> bool:
    """`pattern` is a module class name (``Attention``), a dotted class, or a module path glob;
    true when the op ran inside such a module."""
    path = node.module_path
    while True:
        cls = module_types.get(path, "")
        if cls and (cls == pattern or cls.rsplit(".", 1)[-1] == pattern):
            return True
        if fnmatch.fnmatchcase(path, pattern):
            return True
        if not path:
            return False
        path = path.rsplit(".", 1)[0] if "." in path else ""
