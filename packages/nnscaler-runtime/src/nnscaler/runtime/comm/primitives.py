"""Raw (non-autograd) collectives over a tuple of runtime ranks, counted and with fallbacks.

`ranks` lists the ranks holding the pieces of a value in piece order: piece i lives on
``ranks[i]``. The process group is the cached one of `nnscaler.runtime.grid` for the sorted
ranks (the default group when they are the whole world). torch orders a group's ranks
ascending, so when `ranks` is not sorted the pieces are permuted around each collective.

Every function here takes and returns whole local tensors (any dim, any strides) and returns a
fresh contiguous tensor that shares no memory with its input and is not a view (`own`): the
autograd functions of `collectives` return it as is, and autograd lets in-place ops
(``relu_``, ``add_``) modify the output of a custom Function only when it is not a view.
"""
from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch
import torch.distributed as dist

from nnscaler.ir import LayoutError

from ..device import is_distributed
from ..errors import NnScalerError
from .. import failures
from ..grid import process_group
from . import fallbacks
from .flat import all_gather_flat, reduce_scatter_rows
from .stats import record

__all__ = ["CommError", "UnevenSplitError", "RankSet", "group_for", "resolve", "as_ranks",
           "normalize_dim", "check_divisible", "local_slice", "own", "all_reduce_", "all_gather_",
           "reduce_scatter_", "all_to_all_"]



class CommError(NnScalerError, ValueError):
    """A collective was called with ranks or arguments that cannot work."""


class UnevenSplitError(CommError, LayoutError):
    """A dimension does not split evenly over the ranks (nnscaler only splits evenly)."""


def group_for(ranks: Iterable[int], create: bool = True):
    """The cached process group of `ranks` (any order): the default group for the whole world,
    `None` without a process group.

    With ``create=True`` a missing group is created, which is COLLECTIVE over the default group:
    every rank (member or not) must ask for the same rank sets in the same order, as
    `RankGrid` does for its sync and unit groups. The collectives of this package look groups up
    with ``create=False`` and raise `CommError` for a missing one instead of creating it on the
    member ranks only (which would hang): create sub-unit groups up front with this function or
    `RankGrid.group_of`.
    """
    try:
        return process_group(ranks, create=create)
    except LookupError:
        key = tuple(sorted({int(r) for r in ranks}))
        raise CommError(
            f"no process group exists yet for ranks {key}: create it on every rank, in the same "
            f"order, before the first collective over it (nnscaler.runtime.comm.group_for({key}) "
            f"or RankGrid.group_of); creating it lazily on its members only would hang") from None


class RankSet:
    """A resolved rank tuple: group, size, this rank's piece index, permutations."""

    __slots__ = ("ranks", "n", "index", "group", "backend", "to_group", "to_piece", "is_world", "key")

    def __init__(self, ranks: Tuple[int, ...], index: int, group, is_world: bool,
                 to_group: Optional[torch.Tensor], to_piece: Optional[torch.Tensor]):
        self.ranks, self.n, self.index, self.group = ranks, len(ranks), index, group
        self.is_world, self.key = is_world, tuple(sorted(ranks))
        self.backend = str(dist.get_backend(group))
        # to_group[g] = piece held by group rank g; to_piece[k] = group rank holding piece k;
        # None when ranks are sorted (piece order == group order).
        self.to_group, self.to_piece = to_group, to_piece


def as_ranks(ranks) -> Tuple[int, ...]:
    if isinstance(ranks, int):
        raise CommError(f"ranks must be a tuple of runtime ranks, got the int {ranks!r}")
    out = tuple(int(r) for r in ranks)
    if not out:
        raise CommError("ranks must not be empty")
    if len(set(out)) != len(out):
        raise CommError(f"ranks {out} name a rank twice")
    return out


def resolve(ranks: Tuple[int, ...], op: str) -> RankSet:
    """Resolve a rank tuple of length >= 2 for this process. The group is looked up in
    `nnscaler.runtime.grid`'s registry each time (the one cache of groups: a group destroyed by
    `RankGrid.destroy_all()` or a replaced default group is never used stale)."""
    if not is_distributed():
        raise CommError(
            f"nnscaler.runtime.comm.{op} over ranks {ranks} needs torch.distributed: launch "
            f"{max(ranks) + 1} or more processes and call torch.distributed.init_process_group() first")
    rank, world = dist.get_rank(), dist.get_world_size()
    if min(ranks) < 0 or max(ranks) >= world:
        raise CommError(f"nnscaler.runtime.comm.{op}: ranks {ranks} are not all in 0..{world - 1} "
                        f"(the world has {world} ranks)")
    if rank not in ranks:
        raise CommError(f"nnscaler.runtime.comm.{op}: this rank ({rank}) is not one of ranks {ranks}; "
                        f"only the ranks holding the value may call it")
    ordered = tuple(sorted(ranks))
    to_group = to_piece = None
    if ordered != ranks:
        to_group = torch.tensor([ranks.index(r) for r in ordered])
        to_piece = torch.tensor([ordered.index(r) for r in ranks])
    return RankSet(ranks, ranks.index(rank), group_for(ordered, create=False),
                   ordered == tuple(range(world)), to_group, to_piece)


def normalize_dim(dim: int, ndim: int, op: str, what: str = "dim") -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise CommError(f"nnscaler.runtime.comm.{op}: {what} must be an int, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise CommError(f"nnscaler.runtime.comm.{op}: {what}={dim} is out of range for a "
                        f"{ndim}-dimensional tensor")
    return dim % ndim


def check_divisible(x: torch.Tensor, dim: int, n: int, op: str, ranks) -> int:
    size = x.shape[dim]
    if size % n:
        raise UnevenSplitError(
            f"nnscaler.runtime.comm.{op}: dim {dim} of size {size} (tensor shape {tuple(x.shape)}) "
            f"does not split evenly over n={n} ranks {tuple(ranks)}; nnscaler splits only evenly: "
            f"make that size a multiple of {n} or partition another dimension")
    return size // n


def _what(op: str, rs: "RankSet") -> str:
    """How failure messages name a collective (failures/)."""
    return f"the tensor-parallel {op} over ranks {rs.ranks}"


def _pieces_to_group(stacked: torch.Tensor, rs: RankSet) -> torch.Tensor:
    return stacked if rs.to_group is None else stacked.index_select(0, rs.to_group.to(stacked.device))


def _group_to_pieces(stacked: torch.Tensor, rs: RankSet) -> torch.Tensor:
    return stacked if rs.to_piece is None else stacked.index_select(0, rs.to_piece.to(stacked.device))


def own(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or, when `t` is a view (of a buffer nothing else holds), a tensor on the same
    memory that is not a view: no copy. Autograd refuses in-place ops on a custom Function's
    output that is a view ("Output 0 of _AllToAll is a view and is being modified inplace")."""
    if t._base is None:
        return t
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def _merge_first(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """(n, *shape) -> concatenation of the n pieces along `dim` (contiguous, not a view: when the
    concatenation is a reshape of the stacked buffer, the result owns that buffer)."""
    n, shape = stacked.shape[0], stacked.shape[1:]
    merged = shape[:dim] + (n * shape[dim],) + shape[dim + 1:]
    return own(stacked.movedim(0, dim).reshape(merged).contiguous())


def _split_first(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """x -> (n, *chunk shape): its n even chunks along `dim` stacked first (contiguous)."""
    shape = tuple(x.shape)
    parts = shape[:dim] + (n, shape[dim] // n) + shape[dim + 1:]
    return x.reshape(parts).movedim(dim, 0).contiguous()


def _gather_stacked(x: torch.Tensor, rs: RankSet, label: Optional[str]) -> torch.Tensor:
    """All ranks' `x` stacked as (n, *x.shape) in piece order."""
    flat = all_gather_flat(x, rs.group, rs.n, label=label, what=_what("all_gather", rs))
    return _group_to_pieces(flat.view((rs.n,) + tuple(x.shape)), rs)


def all_reduce_(x: torch.Tensor, rs: RankSet) -> torch.Tensor:
    """Sum of every rank's `x` (full shape)."""
    out = x.clone(memory_format=torch.contiguous_format)
    record("all_reduce", out.nbytes)
    failures.run(dist.all_reduce, out, group=rs.group, what=_what("all_reduce", rs))
    return out


def all_gather_(x: torch.Tensor, dim: int, rs: RankSet) -> torch.Tensor:
    """The pieces of every rank concatenated along `dim`, in piece order."""
    return _merge_first(_gather_stacked(x, rs, "all_gather"), dim)


def reduce_scatter_(x: torch.Tensor, dim: int, rs: RankSet) -> torch.Tensor:
    """Slice `rs.index` along `dim` of the sum of every rank's `x` (full shape, dim divisible)."""
    stacked = _pieces_to_group(_split_first(x, dim, rs.n), rs).contiguous()  # row g: group rank g's piece
    return reduce_scatter_rows(stacked, rs.group, rs.key.index(dist.get_rank()), label="reduce_scatter",
                               what=_what("reduce_scatter", rs), may_overwrite=True)


def all_to_all_(x: torch.Tensor, src_dim: int, dst_dim: int, rs: RankSet) -> torch.Tensor:
    """From piece `rs.index` along `src_dim` to piece `rs.index` along `dst_dim` (dims differ)."""
    n = rs.n
    if fallbacks.uses_fallback("all_to_all", rs.backend, x.device.type):
        record("all_to_all(fallback)", x.nbytes)
        full = _merge_first(_gather_stacked(x, rs, None), src_dim)
        c = full.shape[dst_dim] // n
        return full.narrow(dst_dim, rs.index * c, c).clone(memory_format=torch.contiguous_format)
    send = _pieces_to_group(_split_first(x, dst_dim, n), rs).contiguous()
    recv = torch.empty_like(send)
    record("all_to_all", send.nbytes)
    failures.run(dist.all_to_all_single, recv.view(-1), send.view(-1), group=rs.group,
                 what=_what("all_to_all", rs))
    return _merge_first(_group_to_pieces(recv, rs), src_dim)


def local_slice(x: torch.Tensor, dim: int, rs_index: int, n: int) -> torch.Tensor:
    """Chunk `rs_index` of `n` along `dim`, as a fresh contiguous tensor."""
    c = x.shape[dim] // n
    return x.narrow(dim, rs_index * c, c).clone(memory_format=torch.contiguous_format)

