"""The primitives a policy author uses: select, partition, replicate, assign.

A policy is a function ``policy(graph, compute_config) -> graph`` that gives every op of the
traced graph its pieces and devices with these primitives, for example::

    def my_policy(graph, cfg):
        for node in select(graph, op="linear"):
            for device, piece in enumerate(partition(graph, node, "n", cfg.plan_ngpus)):
                assign(piece, device)
        for node in select(graph, unplanned=True):
            for device, piece in enumerate(replicate(graph, node, cfg.plan_ngpus)):
                assign(piece, device)
        return graph
"""
from __future__ import annotations

import fnmatch
from typing import Callable, List, Optional

from nnscaler.ir import IRGraph, Node
from nnscaler.ir import Replicate

from .plan import Piece, PlanError, tensor_inputs, tensor_outputs


def select(graph: IRGraph, op: Optional[str] = None, module: Optional[str] = None,
           where: Optional[Callable[[Node], bool]] = None, unplanned: bool = False) -> List[Node]:
    """The ops of `graph` (in program order) that match every given filter.

    op: a glob on the op's short name (``linear``) or full target (``torch.nn.functional.*``);
    module: a glob on the module path the op ran in (``layers.*.attn``; ``""`` is the root);
    where: any predicate on the node; unplanned: only ops that have no pieces yet.
    """
    out = []
    for node in graph.nodes:
        if op is not None and not (fnmatch.fnmatchcase(node.short_name, op) or fnmatch.fnmatchcase(node.target, op)):
            continue
        if module is not None and not fnmatch.fnmatchcase(node.module_path, module):
            continue
        if unplanned and node.pieces:
            continue
        if where is not None and not where(node):
            continue
        out.append(node)
    return out


def replicate(graph: IRGraph, node: Node, num: int) -> List[Piece]:
    """Run `node` whole on `num` devices (all inputs and outputs replicated). Returns the pieces."""
    _check_num(node, num)
    n_in, n_out = len(tensor_inputs(graph, node)), len(tensor_outputs(graph, node))
    node.pieces = [Piece(i, num, [Replicate()] * n_in, [Replicate()] * n_out) for i in range(num)]
    return node.pieces


def partition(graph: IRGraph, node: Node, dim: str, num: int) -> List[Piece]:
    """Split `node` into `num` pieces along the annotated dimension `dim`.

    The op's annotation decides the placements: inputs and outputs that carry `dim` are split
    along it (D), those that don't are replicated (R), and splitting a reduced dimension (``k+``)
    makes the outputs value-split (V). Raises PlanError for an op without annotation, an unknown
    or unsplittable dimension, or a size not divisible by `num`.
    """
    _check_num(node, num)
    if node.annotation is None:
        raise PlanError(f"cannot partition op {node.describe()}: it has no dimension annotation "
                        f"(register one with nnscaler.register_op) and can only be replicated")
    bound = bind_annotation(graph, node)
    if bound is None:
        raise PlanError(f"cannot partition op {node.describe()}: its annotation {node.annotation!r} does not "
                        f"fit its tensor shapes, so it can only be replicated")
    try:
        in_places, out_places = bound.partition(dim, num)
    except ValueError as e:
        can = bound.splittable_dims(num)
        raise PlanError(f"cannot partition op {node.describe()} along {dim!r} into {num}: {e}. "
                        f"Dims it can split into {num}: {', '.join(can) if can else 'none (replicate it)'}") from None
    node.pieces = [Piece(i, num, list(in_places), list(out_places), dim) for i in range(num)]
    return node.pieces


def bind_annotation(graph: IRGraph, node: Node):
    """The node's annotation bound to its tensor shapes (a BoundAnnotation), or None when the
    node has no annotation or it does not fit."""
    if node.annotation is None:
        return None
    from nnscaler.ir import parse_annotation
    ins = [graph.value(r).shape for r in tensor_inputs(graph, node)]
    outs = [graph.value(r).shape for r in tensor_outputs(graph, node)]
    try:
        return parse_annotation(node.annotation).bind(ins, outs)
    except ValueError:
        return None


def assign(piece_or_node, device: int):
    """Run a piece (or every piece of a node) on plan device `device`."""
    if not isinstance(device, int) or isinstance(device, bool) or device < 0:
        raise PlanError(f"device must be a non-negative int, got {device!r}")
    pieces = piece_or_node.pieces if isinstance(piece_or_node, Node) else [piece_or_node]
    if not pieces:
        raise PlanError(f"op {piece_or_node.describe()} has no pieces yet: replicate or partition it first")
    for p in pieces:
        p.device = device
    return piece_or_node


def _check_num(node: Node, num: int) -> None:
    if not isinstance(num, int) or isinstance(num, bool) or num < 1:
        raise PlanError(f"number of pieces for op {node.describe()} must be a positive int, got {num!r}")
