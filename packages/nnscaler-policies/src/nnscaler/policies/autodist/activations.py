"""What autograd keeps for backward: autodist's activation memory.

Not every op output is kept: a view shares its input's storage, many ops keep none of their
inputs (add, cat, a copy) or only their output (softmax), ``x * y`` keeps a factor only for the
other's gradient, a shape query keeps nothing, and ``contiguous()`` of a tensor already laid out
in order copies nothing. Counting every output over-estimated the example GPT's activations about
2x; with these rules the estimate is within 1 % of the storages autograd really saves on the GPT
and HF Llama (tests/policies/test_autodist_activations.py). Ops not listed keep their tensor
inputs (conservative).

A graph with both branches of a decision on a tensor's value (nnscaler.ir.tracer.branches) runs
one branch per step, so the ops of only one side keep anything: the estimate takes, over the
decisions' outcomes, the one whose kept tensors weigh most (`counted_branches`). Summing both
sides counted Hugging Face's packed-sequence branch (transformers 5: ``find_packed_sequence_indices``
decides in Python whether the position ids hold several sequences; its other side calls SDPA again
with a 4-D mask) on top of the plain causal SDPA: one attention output per layer, 4 % over the
Llama's real activations.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Dict, List, Optional

import torch

from nnscaler.ir import IRGraph, Node, is_guard

from ..plan import tensor_inputs, tensor_outputs

__all__ = ["saved_for_backward", "direct_keeps", "counted_branches", "runs_in"]

_MAX_DECISIONS = 8  # beyond this many merged decisions, each is settled on its own (others as traced)

_ALIASES = {f"torch.Tensor.{m}" for m in ("view", "view_as", "transpose", "permute", "t", "expand", "expand_as",
                                          "unsqueeze", "squeeze", "split", "chunk", "unbind", "narrow", "select",
                                          "__getitem__", "reshape", "flatten", "unflatten", "movedim", "detach")} | \
    {f"torch.{m}" for m in ("transpose", "permute", "t", "unsqueeze", "squeeze", "split", "chunk", "unbind",
                            "narrow", "select", "reshape", "flatten", "movedim", "detach")}
_KEEP_NO_INPUT = {f"{ns}.{m}" for ns in ("torch", "torch.Tensor", "operator")
                  for m in ("add", "sub", "neg", "cat", "concat", "contiguous", "clone", "masked_fill", "mean", "sum",
                            "float", "to", "type_as", "__add__", "__radd__", "__sub__", "__neg__")}
_KEEP_OUTPUT = {"torch.nn.functional.softmax", "torch.softmax", "torch.Tensor.softmax", "torch.nn.functional.log_softmax",
                "torch.exp", "torch.Tensor.exp", "torch.tanh", "torch.Tensor.tanh", "torch.sigmoid",
                "torch.Tensor.sigmoid", "torch.rsqrt", "torch.Tensor.rsqrt", "torch.sqrt", "torch.Tensor.sqrt",
                "torch.nn.functional.relu", "torch.relu", "torch.nn.functional.scaled_dot_product_attention"}
_KEEP_IF_OTHER_TENSOR = {f"{ns}.{m}" for ns in ("torch", "torch.Tensor", "operator")
                         for m in ("mul", "__mul__", "__rmul__", "multiply")}


def counted_branches(graph: IRGraph) -> Dict[int, bool]:
    """The outcome of each merged decision (guard node id -> value) under which the ops that run
    keep the most bytes for backward: the branches the activation memory is counted for. Empty
    for a graph without merged branches."""
    guards = [n for n in graph.nodes if is_guard(n) and n.kwargs.get("branches")]
    if not guards:
        return {}
    traced = {g.id: bool(g.kwargs.get("traced", True)) for g in guards}
    if len(guards) <= _MAX_DECISIONS:
        worlds = [dict(zip(traced, values)) for values in itertools.product(*[(t, not t) for t in traced.values()])]
        return max(worlds, key=lambda w: _kept_bytes(graph, w))  # ties: the traced branches
    world = dict(traced)
    for gid in traced:  # too many to try every combination: each decision on its own
        world[gid] = max((world[gid], not world[gid]), key=lambda v: _kept_bytes(graph, {**world, gid: v}))
    return world


def runs_in(node: Node, branches: Dict[int, bool]) -> bool:
    """Whether `node` runs when the merged decisions come out as `branches`."""
    return node.branch is None or branches.get(node.branch[0], node.branch[1]) == node.branch[1]


def saved_for_backward(graph: IRGraph, branches: Optional[Dict[int, bool]] = None) -> set:
    """Ids of the values autograd keeps for backward (a view's keep is charged to its base), with
    the merged decisions coming out as `branches` (default: `counted_branches`)."""
    if branches is None:
        branches = counted_branches(graph)
    return _saved(graph, _world_nodes(graph, branches))


def _world_nodes(graph: IRGraph, branches: Dict[int, bool]) -> List[Node]:
    """The ops that run under `branches`, each with the arguments of its branch."""
    if not branches:
        return list(graph.nodes)
    nodes = []
    for node in graph.nodes:
        if not runs_in(node, branches):
            continue
        if node.branch_args:
            args, kwargs = list(node.args), dict(node.kwargs)
            for where, key, gid, when_true, when_false in node.branch_args:
                (args if where == "args" else kwargs)[key] = when_true if branches.get(gid, True) else when_false
            node = dataclasses.replace(node, args=args, kwargs=kwargs)
        nodes.append(node)
    return nodes


def _kept_bytes(graph: IRGraph, branches: Dict[int, bool]) -> float:
    total = 0.0
    for vid in _saved(graph, _world_nodes(graph, branches)):
        value = graph.values[vid]
        if value.requires_grad and value.shape is not None and str(value.dtype).startswith(("float", "bfloat")):
            total += math.prod(value.shape) * getattr(torch, value.dtype).itemsize
    return total


def _saved(graph: IRGraph, nodes: List[Node]) -> set:
    kept = set()
    free_copies = _noop_contiguous(graph, nodes)
    for node in reversed(nodes):
        ins, outs = tensor_inputs(graph, node), tensor_outputs(graph, node)
        if not outs:  # a shape query keeps nothing
            continue
        if node.target in _ALIASES or node.id in free_copies:
            if any(r.id in kept for r in outs):
                kept.update(r.id for r in ins[:1])
            kept.difference_update(r.id for r in outs)  # the storage is the base's
            continue
        if node.target in _KEEP_OUTPUT:
            kept.update(r.id for r in outs)
        kept.update(direct_keeps(graph, node))
    return kept


def direct_keeps(graph: IRGraph, node: Node) -> set:
    """Ids of the tensor inputs `node` itself keeps for backward (none for a view or a shape query)."""
    ins, outs = tensor_inputs(graph, node), tensor_outputs(graph, node)
    if not outs or node.target in _ALIASES or node.target in _KEEP_NO_INPUT:
        return set()
    if node.target in _KEEP_IF_OTHER_TENSOR:
        # x * y keeps y for x's gradient and x for y's: a factor is kept only when the other
        # one needs a gradient (rotary's q * cos keeps cos, not q; measured on the Llama)
        if len(ins) < 2:
            return set()
        return {r.id for i, r in enumerate(ins)
                if any(graph.value(o).requires_grad for j, o in enumerate(ins) if j != i)}
    if node.target in _KEEP_OUTPUT and node.target != _SDPA:
        return set()
    return {r.id for r in ins}


_SDPA = "torch.nn.functional.scaled_dot_product_attention"
_TRANSPOSES = {"torch.Tensor.transpose", "torch.transpose"}
_RESHAPES = {"torch.Tensor.view", "torch.Tensor.reshape", "torch.reshape"}
_ELEMENTWISE = {"add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "tanh", "sigmoid", "relu", "gelu",
                "silu", "to", "float", "type_as", "masked_fill", "__add__", "__radd__", "__sub__", "__mul__",
                "__rmul__", "__truediv__", "__neg__", "dropout"}


def _noop_contiguous(graph: IRGraph, nodes: List[Node]) -> set:
    """Ids of the ``contiguous()`` ops that copy nothing because their input is laid out in order
    already. Tracks each value's physical dim order: torch's attention kernel lays its output out
    like its query, which HF makes as ``linear(x).view(b, s, h, d).transpose(1, 2)``, so that
    ``sdpa(...).transpose(1, 2).contiguous()`` is free (Llama's attention output was counted twice
    without this)."""
    order: Dict[int, Optional[tuple]] = {}  # value id -> physical order of its logical dims (None: unknown)
    noop = set()
    for node in nodes:
        ins, outs = tensor_inputs(graph, node), tensor_outputs(graph, node)
        if not outs:
            continue
        src = order.get(ins[0].id, tuple(range(len(graph.value(ins[0]).shape or ())))) if ins else None
        out_nd = len(graph.value(outs[0]).shape or ())
        if node.target == _SDPA:
            got = src if src is not None and len(src) == out_nd else tuple(range(out_nd))
        elif node.target == "torch.Tensor.contiguous":
            if src is not None and src == tuple(range(len(src))):
                noop.add(node.id)
            got = tuple(range(out_nd))
        elif node.target in _TRANSPOSES and src is not None and len(node.args) == 3 \
                and all(isinstance(d, int) for d in node.args[1:]):
            a, b = (d % len(src) for d in node.args[1:])
            swap = {a: b, b: a}
            got = tuple(swap.get(d, d) for d in src)
        elif node.target in _RESHAPES:
            same = src is not None and tuple(graph.value(ins[0]).shape) == tuple(graph.value(outs[0]).shape)
            got = src if same else (tuple(range(out_nd)) if src == tuple(range(len(src or ()))) and src is not None
                                    else None)
        elif node.target in _ALIASES:
            got = None
        elif node.short_name in _ELEMENTWISE and src is not None and len(src) == out_nd:
            got = src  # an elementwise op lays its output out like its first input
        else:
            got = tuple(range(out_nd))
        for r in outs:
            order[r.id] = got
    return noop
