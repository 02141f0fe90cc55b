"""Expert parallelism with ``ep_size`` k between 1 and a unit's n ranks: the experts stored 1/n per rank.

Storage is that of full expert parallelism: the rank at piece i of the unit holds experts
``[i * E/n, (i + 1) * E/n)`` (weights, gradients and optimizer state alike). The tokens travel only
inside groups of k consecutive pieces, so the rank at group position ``p = i % k`` computes E/k
experts: those of its replica set, the n/k pieces ``p, p + k, p + 2k, ...`` (same position in every
group). It gathers them at forward by `comm.all_gather_rs`, whose backward reduce-scatters the
gradient over the replica set: the groups' gradients of the same experts are summed and each rank
keeps its own shard's. The gathered experts of a layer stay alive from its forward to its backward
(the expert MLPs save them).

A position's experts are not contiguous ids, so the exchange works in *group ids*: position-major,
position p's experts at ``[p * E/k, (p + 1) * E/k)`` in the order it gathered them (`group_expert_ids`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from nnscaler.ir import packed_expert_width

from .comm.collectives import all_gather_rs
from .comm.primitives import CommError

__all__ = ["ExpertGroups", "expert_groups", "group_expert_ids", "gather_experts"]


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's share of a unit under ``ep_size`` k: `group` (the k ranks exchanging tokens, in piece
    order), `first` (the group's first piece in the unit), `position` (this rank's index in `group`) and
    `replicas` (the ranks whose stored experts this rank computes, in the order they are gathered)."""

    group: Tuple[int, ...]
    first: int
    position: int
    replicas: Tuple[int, ...]


def expert_groups(ranks: Sequence[int], k: int, index: int) -> ExpertGroups:
    """The groups of `ranks` (a unit, piece order) for the rank at piece `index`, with ``ep_size`` `k`."""
    n = len(ranks)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or n % k:
        raise CommError(f"nnscaler.runtime.moe.expert_parallel: ep_size={k!r} must be a whole number dividing the "
                        f"{n} ranks {tuple(ranks)}")
    first, position = index - index % k, index % k
    return ExpertGroups(tuple(ranks[first:first + k]), first, position, tuple(ranks[position::k]))


def group_expert_ids(num_experts: int, n: int, k: int) -> torch.Tensor:
    """(num_experts + 1,) int64: the group id of each original expert id, with `num_experts` (a pair
    dropped over capacity) kept as is. Original expert e is stored at piece ``u = e // (E/n)``, which is
    gathered by position ``u % k`` as its ``u // k``-th shard."""
    if num_experts % n or n % k:
        raise CommError(f"nnscaler.runtime.moe.expert_parallel: {num_experts} experts do not split over {n} ranks "
                        f"in groups of ep_size={k}")
    shard = num_experts // n
    e = torch.arange(num_experts)
    piece, offset = e // shard, e % shard
    ids = (piece % k) * (num_experts // k) + (piece // k) * shard + offset
    return torch.cat([ids, torch.tensor([num_experts])])


def gather_experts(weights: Sequence[Optional[torch.Tensor]], replicas: Tuple[int, ...]):
    """`weights` (each this rank's stored experts along dim 0, or None) with the experts of every rank of
    `replicas`, concatenated in their order. One all-gather (backward: one reduce-scatter) for all of them
    when they share a dtype and device: each expert's weights packed in one row, each weight's part
    padded (`packed_expert_width`) so that every returned view starts and strides on 16 bytes (what
    CUDA's grouped GEMM asks of its weights). COLLECTIVE over `replicas`."""
    present = [w for w in weights if w is not None]
    if len({(w.dtype, w.device) for w in present}) != 1:
        gathered = iter([all_gather_rs(w, 0, replicas) for w in present])
        return tuple(None if w is None else next(gathered) for w in weights)
    local = present[0].shape[0]
    widths = [w[0].numel() for w in present]
    padded = [packed_expert_width(width) for width in widths]
    rows = [F.pad(w.reshape(local, -1), (0, p - width)) for w, width, p in zip(present, widths, padded)]
    flat = all_gather_rs(torch.cat(rows, dim=1), 0, replicas)
    parts = iter(part[:, :width] for part, width in zip(flat.split(padded, dim=1), widths))
    return tuple(None if w is None else next(parts).reshape((flat.shape[0],) + tuple(w.shape[1:])) for w in weights)
