"""ZeRO's process groups: the zero group of each plan device's sync ranks (the ranks that
together hold one copy of the optimizer state), the cross group (the same shard index in every
zero group) and the norm group (the units of a zero group, where the gradient norm is summed).
See `nnscaler.runtime.zero` for how the engine uses them."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Sequence, Tuple

from nnscaler.ir.contracts import ZeroGeometry

__all__ = ["ZeroGroups", "make_zero_groups"]


@dataclass(frozen=True)
class ZeroGroups(ZeroGeometry):
    """This rank's zero group, cross group and norm group (ranks and process groups; a group of
    one rank is None and never communicated over). The ranks are a `ZeroGeometry` (nnscaler.ir),
    the record the layout shares."""

    norm_ranks: Tuple[int, ...]  # the units of this zero group: where the gradient norm is summed
    group: Any = None
    cross_group: Any = None
    norm_group: Any = None

    @property
    def size(self) -> int:
        return self.group_size

    def geometry(self) -> Dict[str, Any]:
        """The `ZeroGeometry` fields, by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(ZeroGeometry)}


def make_zero_groups(grid, ngroups: int) -> ZeroGroups:
    """The zero groups of `grid` (a RankGrid) split `zero_ngroups` ways (a validated
    ComputeConfig's, dividing the data-parallel size). COLLECTIVE the first time:
    every rank creates every group, in the same order (all plan devices' zero groups, then their
    cross groups, then the norm groups)."""
    plan, dp = grid.plan_ngpus, grid.dp_size
    z = dp // ngroups  # ngroups divides dp: checked once, by ComputeConfig

    def make(sets: Sequence[Tuple[int, ...]]) -> Dict[Tuple[int, ...], Any]:
        return {s: (grid.group(s) if len(s) > 1 else None) for s in sets}

    zero_sets = [grid.sync_ranks_of(d)[g * z:(g + 1) * z] for d in range(plan) for g in range(ngroups)]
    cross_sets = [grid.sync_ranks_of(d)[i::z] for d in range(plan) for i in range(z)]
    norm_sets = [tuple(range(g * z * plan, (g + 1) * z * plan)) for g in range(ngroups)]
    zero_groups, cross_groups, norm_groups = make(zero_sets), make(cross_sets), make(norm_sets)
    sync = grid.sync_ranks
    index, group_id = grid.dp_rank % z, grid.dp_rank // z
    mine = sync[group_id * z:(group_id + 1) * z]
    cross = sync[index::z]
    norm = tuple(range(group_id * z * plan, (group_id + 1) * z * plan))
    return ZeroGroups(grid.rank, grid.runtime_ngpus, plan, dp, ngroups, mine, index, group_id, cross, norm,
                      zero_groups[mine], cross_groups[cross], norm_groups[norm])
