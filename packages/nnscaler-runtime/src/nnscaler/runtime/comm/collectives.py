"""Layout transitions as autograd functions: each forward collective with its dual in backward.

Layouts: ``R`` replicated, ``V`` partial sums, ``D(dim)`` even split, piece i on ``ranks[i]``;
``R*`` is ``R`` read by a partitioned op, whose ranks each produce only a partial gradient.
Gradient invariant kept by every function: the local gradient of an ``R`` or ``V`` value is
the full gradient on every rank, that of ``D(dim)`` is its slice of the full gradient, those of
``R*`` are partial gradients summing to the full gradient.

=====================  ==============  ===============================  ========================
function               layouts         forward                          backward
=====================  ==============  ===============================  ========================
split(x, dim)          R -> D(dim)     own chunk (no communication)     all_gather
all_gather(x, dim)     D(dim) -> R     all_gather                       own chunk
all_reduce(x)          V -> R          all_reduce                       identity
reduce_scatter(x,dim)  V -> D(dim)     reduce_scatter                   all_gather
all_to_all(x,s,d)      D(s) -> D(d)    all_to_all                       all_to_all (d -> s)
to_partial(x)          R -> V          piece 0 keeps x, others zeros    identity
shard_to_partial(x,d)  D(d) -> V       zeros with own slice filled      own chunk
grad_all_reduce(x)     R -> R*         identity (a copy)                all_reduce
all_gather_rs(x, dim)  D(dim) -> R*    all_gather                       reduce_scatter
all_reduce_ar(x)       V -> R*         all_reduce                       all_reduce
=====================  ==============  ===============================  ========================

Every function takes `ranks`, the tuple of runtime ranks holding the pieces in piece order, and
is the identity (no communication, `x` itself) when `ranks` has one rank. Negative dims count
from the end.

In-place safety: every output, forward and backward, is a fresh contiguous tensor that is not a
view and shares no memory with the input, so in-place ops (``relu_``, ``add_``, ``mul_``, a
``ReLU(inplace=True)``) may modify it and the input stays intact. Where the collective already
produces a fresh buffer this costs nothing (`primitives.own` drops the view-ness of a reshaped
receive buffer without a copy); the one copy is `grad_all_reduce`'s forward, whose result is
the input's value: it is a clone (autograd refuses in-place ops on an input returned as is),
except for a weight (``weight=True``, which generated code passes for a parameter: what a replicated
weight is under cp, tp, ep; or an ``nn.Parameter``), which it returns as a view of itself: an op that
saves the weight for backward (a linear layer, the head of the vocabulary's size) then saves the
parameter, not a copy a step. Under ZeRO-3 the weight is the unit's gathered tensor, not a
parameter, and the view shares its storage, so ZeRO-3 frees it after forward and gathers it again
for backward as it does for any use of the weight. A weight is not modified in place in forward
(autograd refuses it on a leaf that requires grad, and on a custom function's view).
Backward identities (`all_reduce`, `to_partial`) pass the incoming gradient on, as autograd does.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd import Function

from .primitives import (
    all_gather_, all_reduce_, all_to_all_, as_ranks, check_divisible, local_slice, normalize_dim,
    reduce_scatter_, resolve)

__all__ = ["split", "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "to_partial",
           "shard_to_partial", "grad_all_reduce", "all_gather_rs", "all_reduce_ar", "TRANSITIONS"]

# name -> (source layout, destination layout), for documentation and codegen cross-checks.
TRANSITIONS = {
    "split": ("R", "D"), "all_gather": ("D", "R"), "all_reduce": ("V", "R"),
    "reduce_scatter": ("V", "D"), "all_to_all": ("D", "D"), "to_partial": ("R", "V"),
    "shard_to_partial": ("D", "V"), "grad_all_reduce": ("R", "R*"), "all_gather_rs": ("D", "R*"),
    "all_reduce_ar": ("V", "R*"),
}


# -- autograd functions: each forward paired with its dual in backward -------------------------
def _own_chunk(x, dim, rs):
    return local_slice(x, dim, rs.index, rs.n)


def _identity(x, *args):
    return x


def _copy(x, *args):
    """A fresh copy (forward of an identity transition: the output may be modified in place); a
    parameter's view of itself (see the module docstring)."""
    if isinstance(x, torch.nn.Parameter):
        return x.view_as(x)
    return x.clone(memory_format=torch.contiguous_format)


def _alias(x, *args):
    """A weight's view of itself (see the module docstring)."""
    return x.view_as(x)


def _keep_on_first(x, rs):
    if rs.index == 0:
        return x.clone(memory_format=torch.contiguous_format)
    return torch.zeros_like(x, memory_format=torch.contiguous_format)


def _pad_to_full(x, dim, rs):
    shape = list(x.shape)
    c = shape[dim]
    shape[dim] = c * rs.n
    out = x.new_zeros(shape)
    out.narrow(dim, rs.index * c, c).copy_(x)
    return out


def _reverse_all_to_all(grad, src_dim, dst_dim, rs):
    return all_to_all_(grad, dst_dim, src_dim, rs)


def _dual(name: str, forward, backward) -> type:
    """An autograd Function running ``forward(x, *args)`` and, in backward, ``backward(grad, *args)``."""
    def fwd(ctx, x, *args):
        ctx.args = args
        return forward(x, *args)

    def bwd(ctx, grad):
        return (backward(grad, *ctx.args),) + (None,) * len(ctx.args)

    return type(name, (Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_Split = _dual("_Split", _own_chunk, all_gather_)
_AllGather = _dual("_AllGather", all_gather_, _own_chunk)
_AllReduce = _dual("_AllReduce", all_reduce_, _identity)
_ReduceScatter = _dual("_ReduceScatter", reduce_scatter_, all_gather_)
_AllToAll = _dual("_AllToAll", all_to_all_, _reverse_all_to_all)
_ToPartial = _dual("_ToPartial", _keep_on_first, _identity)
_ShardToPartial = _dual("_ShardToPartial", _pad_to_full, _own_chunk)
_GradAllReduce = _dual("_GradAllReduce", _copy, all_reduce_)  # Megatron's f
_GradAllReduceWeight = _dual("_GradAllReduceWeight", _alias, all_reduce_)
_AllGatherRS = _dual("_AllGatherRS", all_gather_, reduce_scatter_)
_AllReduceAR = _dual("_AllReduceAR", all_reduce_, all_reduce_)


# -- public functions (what generated code calls as nr.comm.<name>) -------------------------------
def _apply(fn, name: str, x: torch.Tensor, ranks, dims=(), divisible: Optional[int] = None):
    """Validate the arguments, skip a group of one, and run autograd function `fn`.

    dims: (label, value) pairs normalised against x; divisible: index into dims of the dim that
    must split evenly over the ranks.
    """
    ranks = as_ranks(ranks)
    dims = [normalize_dim(value, x.dim(), name, label) for label, value in dims]
    if len(ranks) == 1 or (name == "all_to_all" and dims[0] == dims[1]):
        return x
    if divisible is not None:
        check_divisible(x, dims[divisible], len(ranks), name, ranks)
    return fn.apply(x, *dims, resolve(ranks, name))


def split(x: torch.Tensor, dim: int, ranks) -> torch.Tensor:
    """R -> D(dim): this rank's chunk of `x` along `dim` (no communication); bwd all-gather."""
    return _apply(_Split, "split", x, ranks, [("dim", dim)], divisible=0)


def all_gather(x: torch.Tensor, dim: int, ranks) -> torch.Tensor:
    """D(dim) -> R: concatenate every rank's piece along `dim`; bwd keeps the own chunk."""
    return _apply(_AllGather, "all_gather", x, ranks, [("dim", dim)])


def all_reduce(x: torch.Tensor, ranks) -> torch.Tensor:
    """V -> R: sum the partial values; bwd identity."""
    return _apply(_AllReduce, "all_reduce", x, ranks)


def reduce_scatter(x: torch.Tensor, dim: int, ranks) -> torch.Tensor:
    """V -> D(dim): this rank's chunk along `dim` of the sum; bwd all-gather."""
    return _apply(_ReduceScatter, "reduce_scatter", x, ranks, [("dim", dim)], divisible=0)


def all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, ranks) -> torch.Tensor:
    """D(src_dim) -> D(dst_dim); bwd the reverse all-to-all. Identity when the dims are equal."""
    return _apply(_AllToAll, "all_to_all", x, ranks, [("src_dim", src_dim), ("dst_dim", dst_dim)], divisible=1)


def to_partial(x: torch.Tensor, ranks) -> torch.Tensor:
    """R -> V: piece 0 keeps `x`, the others hold zeros (no communication); bwd identity."""
    return _apply(_ToPartial, "to_partial", x, ranks)


def shard_to_partial(x: torch.Tensor, dim: int, ranks) -> torch.Tensor:
    """D(dim) -> V: zeros of the full shape with the own slice filled (no communication);
    bwd keeps the own chunk."""
    return _apply(_ShardToPartial, "shard_to_partial", x, ranks, [("dim", dim)])


def grad_all_reduce(x: torch.Tensor, ranks, weight: bool = False) -> torch.Tensor:
    """R -> R*: identity forward; bwd all-reduces the partial gradients (Megatron's "f"). `weight`:
    `x` is a weight, passed on as a view of itself instead of a copy."""
    return _apply(_GradAllReduceWeight if weight else _GradAllReduce, "grad_all_reduce", x, ranks)


def all_gather_rs(x: torch.Tensor, dim: int, ranks) -> torch.Tensor:
    """D(dim) -> R*: all-gather; bwd reduce-scatters the partial gradients (sum, own chunk)."""
    return _apply(_AllGatherRS, "all_gather_rs", x, ranks, [("dim", dim)])


def all_reduce_ar(x: torch.Tensor, ranks) -> torch.Tensor:
    """V -> R*: all-reduce; bwd all-reduces the partial gradients."""
    return _apply(_AllReduceAR, "all_reduce_ar", x, ranks)
