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
grad_all_reduce(x)     R -> R*         identity                         all_reduce
all_gather_rs(x, dim)  D(dim) -> R*    all_gather                       reduce_scatter
all_reduce_ar(x)       V -> R*         all_reduce                       all_reduce
=====================  ==============  ===============================  ========================

Every function takes `ranks`, the tuple of runtime ranks holding the pieces in piece order, and
is the identity (no communication, `x` itself) when `ranks` has one rank. Negative dims count
from the end. Outputs are fresh contiguous tensors, except for the identities
(`grad_all_reduce`'s forward returns `x` as autograd's alias of it: modifying that output in
place is refused by autograd; clone it first if a consumer must).
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


# -- autograd functions ---------------------------------------------------------------------------
class _Split(Function):
    @staticmethod
    def forward(ctx, x, dim, rs):
        ctx.dim, ctx.rs = dim, rs
        return local_slice(x, dim, rs.index, rs.n)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_(grad, ctx.dim, ctx.rs), None, None


class _AllGather(Function):
    @staticmethod
    def forward(ctx, x, dim, rs):
        ctx.dim, ctx.rs = dim, rs
        return all_gather_(x, dim, rs)

    @staticmethod
    def backward(ctx, grad):
        return local_slice(grad, ctx.dim, ctx.rs.index, ctx.rs.n), None, None


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, x, rs):
        return all_reduce_(x, rs)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx, x, dim, rs):
        ctx.dim, ctx.rs = dim, rs
        return reduce_scatter_(x, dim, rs)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_(grad, ctx.dim, ctx.rs), None, None


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, rs):
        ctx.src_dim, ctx.dst_dim, ctx.rs = src_dim, dst_dim, rs
        return all_to_all_(x, src_dim, dst_dim, rs)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_(grad, ctx.dst_dim, ctx.src_dim, ctx.rs), None, None, None


class _ToPartial(Function):
    @staticmethod
    def forward(ctx, x, rs):
        if rs.index == 0:
            return x.clone(memory_format=torch.contiguous_format)
        return torch.zeros_like(x, memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ShardToPartial(Function):
    @staticmethod
    def forward(ctx, x, dim, rs):
        ctx.dim, ctx.rs = dim, rs
        shape = list(x.shape)
        c = shape[dim]
        shape[dim] = c * rs.n
        out = x.new_zeros(shape)
        out.narrow(dim, rs.index * c, c).copy_(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        return local_slice(grad, ctx.dim, ctx.rs.index, ctx.rs.n), None, None


class _GradAllReduce(Function):
    @staticmethod
    def forward(ctx, x, rs):
        ctx.rs = rs
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_(grad, ctx.rs), None


class _AllGatherRS(Function):
    @staticmethod
    def forward(ctx, x, dim, rs):
        ctx.dim, ctx.rs = dim, rs
        return all_gather_(x, dim, rs)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_(grad, ctx.dim, ctx.rs), None, None


class _AllReduceAR(Function):
    @staticmethod
    def forward(ctx, x, rs):
        ctx.rs = rs
        return all_reduce_(x, rs)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_(grad, ctx.rs), None


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


def grad_all_reduce(x: torch.Tensor, ranks) -> torch.Tensor:
    """R -> R*: identity forward; bwd all-reduces the partial gradients (Megatron's "f")."""
    return _apply(_GradAllReduce, "grad_all_reduce", x, ranks)


def all_gather_rs(x: torch.Tensor, dim: int, ranks) -> torch.Tensor:
    """D(dim) -> R*: all-gather; bwd reduce-scatters the partial gradients (sum, own chunk)."""
    return _apply(_AllGatherRS, "all_gather_rs", x, ranks, [("dim", dim)])


def all_reduce_ar(x: torch.Tensor, ranks) -> torch.Tensor:
    """V -> R*: all-reduce; bwd all-reduces the partial gradients."""
    return _apply(_AllReduceAR, "all_reduce_ar", x, ranks)
