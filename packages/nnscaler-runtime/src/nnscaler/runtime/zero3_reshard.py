"""``use_zero=3`` units resharded to a smaller group after forward (FSDP2's ``reshard_after_forward``
as an int k: ``pas_config["zero3_reshard_after_forward"]``, `contracts.reshard_sizes`).

The zero group of z ranks is cut into z/k *smaller groups* of k consecutive ranks (intra-node, when
ranks are numbered node by node). When forward leaves such a unit, each rank keeps, instead of
nothing, its 1/k *part* of the gathered unit: elements ``[j*P, (j+1)*P)`` of the padded flat buffer
(``P = padded / k``, j its position in its smaller group), so every smaller group holds the whole
unit. Backward (and recomputation) all-gathers the unit from the parts over the smaller group only:
k ranks instead of z, trading 1/k of the unit per rank between forward and backward for less
communication. A part is dropped when the unit's gradient is reduce-scattered (over the whole zero
group, as for any unit) and whenever everything is freed (the end of backward, a forward without
gradients, ``unsharded()``): nothing stays after backward, and no part outlives a step. k = z is
the default (freed, gathered from the shards) and k = 1 keeps the unit gathered (False).

The smaller groups are made on every rank, in one order, for every k the setting names (whatever
units a rank holds): every plan device's zero groups, cut in order. The parts are sliced from the
gathered buffer, so they have its dtype whatever the shards'.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from .comm.flat import all_gather_flat, start_all_gather_flat

__all__ = ["SmallerGroup", "SmallerReshard", "ReshardStats", "make_smaller_groups", "smaller_rank_sets"]


@dataclass(frozen=True)
class SmallerGroup:
    """This rank's smaller group of `size` ranks inside its zero group."""

    size: int
    index: int  # this rank's position in `ranks`
    ranks: Tuple[int, ...]
    group: Any = None


def smaller_rank_sets(plan_ngpus: int, runtime_ngpus: int, ngroups: int, k: int) -> List[Tuple[int, ...]]:
    """Every smaller group of k ranks, in creation order: each plan device's zero groups (its sync ranks
    ``d, d + plan_ngpus, ...`` cut `ngroups` ways) cut in order into groups of k consecutive ranks."""
    z = runtime_ngpus // plan_ngpus // ngroups
    out = []
    for d in range(plan_ngpus):
        ranks = tuple(range(d, runtime_ngpus, plan_ngpus))
        for g in range(ngroups):
            zero = ranks[g * z:(g + 1) * z]
            out += [zero[a * k:(a + 1) * k] for a in range(z // k)]
    return out


def make_smaller_groups(grid, ngroups: int, sizes: Sequence[int]) -> Dict[int, SmallerGroup]:
    """k -> this rank's `SmallerGroup` of k ranks, for every k in `sizes` (each dividing the zero group
    size ``dp // ngroups``: checked by `contracts.reshard_sizes`). COLLECTIVE the first time: every rank
    creates every group in the same order (by k, then `smaller_rank_sets`' order)."""
    out = {}
    for k in sorted(set(sizes)):
        for sub in smaller_rank_sets(grid.plan_ngpus, grid.runtime_ngpus, ngroups, k):
            group = grid.group(sub)
            if grid.rank in sub:
                out[k] = SmallerGroup(k, sub.index(grid.rank), sub, group)
    return out


@dataclass
class ReshardStats:
    """Counters for tests and benchmarks."""

    kept: int = 0  # parts kept when forward left a unit
    gathers: int = 0  # all-gathers from the parts (backward, recomputation), each over a smaller group
    group_sizes: Set[int] = field(default_factory=set)  # the sizes of the groups those gathered over
    held_numel: int = 0  # elements of the parts held now
    max_held_numel: int = 0  # the most held at once


class SmallerReshard:
    """The parts of the units resharded to a smaller group (`FullyShardedParams.smaller`)."""

    def __init__(self, sizes: Mapping[str, int], groups: Mapping[int, SmallerGroup]):
        """`sizes`: unit name -> k (only the units with 1 < k < z); `groups`: k -> this rank's group."""
        self.group_of: Dict[str, SmallerGroup] = {u: groups[k] for u, k in sizes.items()}
        self.parts: Dict[int, torch.Tensor] = {}  # id(unit) -> its part
        self.stats = ReshardStats()

    def __bool__(self) -> bool:
        return bool(self.group_of)

    def holds(self, u) -> bool:
        return id(u) in self.parts

    def keep(self, u, full: torch.Tensor) -> None:
        """Forward leaves `u`, gathered as `full`: keep this rank's part of it (a copy: `full` is freed)."""
        g = self.group_of.get(u.name)
        if g is None or id(u) in self.parts:
            return
        width = full.numel() // g.size
        self.parts[id(u)] = full[g.index * width:(g.index + 1) * width].clone()
        st = self.stats
        st.kept += 1
        st.held_numel += width
        st.max_held_numel = max(st.max_held_numel, st.held_numel)

    def drop(self, u) -> None:
        part = self.parts.pop(id(u), None)
        if part is not None:
            self.stats.held_numel -= part.numel()

    def gather(self, u) -> torch.Tensor:
        """`u`'s gathered flat buffer from the parts: COLLECTIVE over its smaller group."""
        g, part = self.group_of[u.name], self.parts[id(u)]
        self._count(g)
        return all_gather_flat(part, g.group, g.size, label="zero3_all_gather",
                               what="the fully sharded parameter all-gather (from a smaller group)")

    def start(self, u) -> Optional[tuple]:
        """`gather` launched without waiting: ``(work, full)``, or None where the backend needs the
        blocking fallback."""
        g, part = self.group_of[u.name], self.parts[id(u)]
        started = start_all_gather_flat(part, g.group, g.size, label="zero3_all_gather")
        if started is not None:
            self._count(g)
        return started

    def _count(self, g: SmallerGroup) -> None:
        self.stats.gathers += 1
        self.stats.group_sizes.add(g.size)
