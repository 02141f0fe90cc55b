"""One op as Python statements: its call on rendered arguments, and what a piece of a split op
changes in it (shape arguments of the local piece, sizes scaled back to full sizes).

Also the op's context (the grad mode / autocast region it ran in) and its user source line.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

from nnscaler.ir import IRGraph, Node, Ref, Shard, is_guard

from .branches import branch_if, with_branch_args
from .errors import GenerationError
from .guards import guard_statement
from .layouts import UnitPlan, is_shape_query
from .render import ModeChoice, RawExpr, Renderer

__all__ = ["statement", "rescale_sizes", "unpack_target", "context_line", "describe_source"]

# Ops whose arguments spell (part of) their output shape: a piece gets its local shape. The
# factories are split by `cp` only (their written base, policies/builtin/_cp_writes.py).
_SHAPE_ARG_OPS = {"torch.Tensor.view", "torch.Tensor.reshape", "torch.reshape", "torch.Tensor.expand",
                  "torch.Tensor.new_empty", "torch.Tensor.new_zeros", "torch.Tensor.new_ones"}


def statement(node: Node, renderer: Renderer, graph: IRGraph, unit: UnitPlan) -> List[str]:
    """The lines running `node` (its local piece) with `renderer`'s names."""
    args, kwargs = node.args, node.kwargs
    if unit.partitioned.get(node.id) and node.target in _SHAPE_ARG_OPS:
        args = _localize_shape_args(node, graph, unit)
    if node.branch_args:  # arguments that differ between the branches of a decision
        args, kwargs = with_branch_args(node, args, kwargs)
    if node.mode_args:  # constants that differ between training and eval (nnscaler.ir.tracer.modes)
        args, kwargs = list(args), dict(kwargs)
        for where, key, train, eval_ in node.mode_args:
            (args if where == "args" else kwargs)[key] = ModeChoice(train, eval_)
    if is_guard(node):  # a decision the trace took on a tensor's value (codegen/guards.py)
        return guard_statement(node, renderer, graph.pipeline is not None, args, kwargs, unit.plan_ngpus)
    if node.target == "torch.Tensor.__setitem__":
        tgt, idx, val = args[:3]
        lines = [f"{renderer.value(tgt)}[{renderer.value(idx, in_index=True)}] = {renderer.value(val)}"]
        if node.outputs is not None:
            lines.append(f"{renderer.value(node.outputs)} = {renderer.value(tgt)}")
        return lines
    expr = renderer.call(node.target, args, kwargs)
    if node.outputs is None:
        return [expr]
    lhs = renderer.value(node.outputs)
    if isinstance(node.outputs, (tuple, list)):
        lhs = unpack_target(node.outputs, renderer)
    return [f"{lhs} = {expr}"]


def _localize_shape_args(node: Node, graph: IRGraph, unit: UnitPlan) -> list:
    """The shape arguments of one piece: the split output dim holds 1/n of its full size.

    Shape values in the generated code always describe full tensors (see `rescale_sizes`), so
    the piece divides the entry of the split dim; -1 entries infer themselves.
    """
    out = [r for r in node.output_refs() if graph.value(r).is_tensor][0]
    placement = unit.produced[out.id]
    if not isinstance(placement, Shard):
        return node.args
    ndim = len(graph.value(out).shape)
    dim = placement.dim % ndim
    n = unit.plan_ngpus
    first, rest = node.args[0], list(node.args[1:])
    packed = len(rest) == 1 and isinstance(rest[0], (tuple, list))
    shape = list(rest[0]) if packed else rest
    if len(shape) != ndim:
        raise GenerationError(f"op {node.describe()}: cannot localize shape arguments {shape} of a split output")
    if not (isinstance(shape[dim], int) and shape[dim] == -1):
        shape[dim] = _Divided(shape[dim], n)
    return [first, tuple(shape)] if packed else [first, *shape]


class _Divided(RawExpr):
    """`value // n` in generated code (value: an int or a Ref to a traced int)."""

    def __init__(self, value, n):
        self.value, self.n = value, n

    def render(self, renderer) -> str:
        if isinstance(self.value, int):
            return repr(self.value // self.n)
        return f"({renderer.value(self.value)} // {self.n})"


def rescale_sizes(node: Node, unit: UnitPlan, names: Dict[int, str], graph: IRGraph,
                  received=frozenset()) -> List[str]:
    """Traced ints are full sizes: a size taken of a split tensor is scaled back up.

    A size read of a value that differs between the branches of a decision
    (``(a if _branch_N else b).shape``) is scaled per branch: the plan may split `a` and `b`
    along different dims, and scaling by the base side's layout alone gave the other side's
    sizes wrong (a reshape then silently mixed the batch with the heads).
    """
    if not is_shape_query(node) or node.outputs is None:
        return []
    choices = [(gid, t, f) for where, key, gid, t, f in node.branch_args if where == "args" and key == 0]
    if not choices:
        return _rescale(node, node.args[0], unit, names, graph, received)
    gid, when_true, when_false = choices[-1]  # the one `with_branch_args` renders
    on_true = _rescale(node, when_true, unit, names, graph, received)
    on_false = _rescale(node, when_false, unit, names, graph, received)
    if on_true == on_false:
        return on_true
    lines: List[str] = []
    for side, side_lines in ((True, on_true), (False, on_false)):
        if side_lines:
            lines += [branch_if(gid, side)] + ["    " + line for line in side_lines]
    return lines


def _rescale(node: Node, src, unit: UnitPlan, names: Dict[int, str], graph: IRGraph, received) -> List[str]:
    """The lines scaling `node`'s sizes of `src` (one value) back to full sizes."""
    placement = unit.produced.get(src.id) if isinstance(src, Ref) and src.id not in received else None
    if not isinstance(placement, Shard):
        return []
    n = unit.plan_ngpus
    outs = node.outputs
    if node.target == "torch.Tensor.numel":
        return [f"{names[outs.id]} = {names[outs.id]} * {n}"]
    ndim = len(graph.value(src).shape)
    if isinstance(outs, Ref):  # x.size(dim)
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        same = isinstance(dim, int) and dim % ndim == placement.dim % ndim
        return [f"{names[outs.id]} = {names[outs.id]} * {n}"] if same else []
    ref = outs[placement.dim % ndim]
    return [f"{names[ref.id]} = {names[ref.id]} * {n}"] if isinstance(ref, Ref) else []


def unpack_target(outputs, renderer) -> str:
    """The assignment target of nested outputs: ``(a, (b, c))``."""
    if isinstance(outputs, Ref):
        return renderer.value(outputs)
    inner = ", ".join(unpack_target(o, renderer) for o in outputs)
    if len(outputs) == 1:
        inner += ","
    return f"({inner})" if outputs else "_"


def context_line(node: Node) -> Optional[str]:
    """The `with` line re-creating the grad mode / autocast region the op ran in, or None."""
    parts = [] if node.grad_enabled else ["torch.no_grad()"]
    if node.autocast is not None:
        parts.append(f"torch.autocast({node.autocast[0]!r}, dtype=torch.{node.autocast[1]})")
    return f"with {', '.join(parts)}:" if parts else None


def describe_source(node: Node, full: bool = False) -> str:
    """The user's line of `node` (``file:line in function (module): code``), "" when unknown."""
    if node.source is None:
        return f"({node.module_path})" if node.module_path else ""
    path = node.source.file if full else os.path.basename(node.source.file)
    where = f"{path}:{node.source.line}"
    mod = f" ({node.module_path})" if node.module_path else ""
    fn = f" in {node.source.function}" if node.source.function else ""
    return f"{where}{fn}{mod}: {node.source.code}"
