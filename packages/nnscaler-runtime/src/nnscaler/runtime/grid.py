"""The rank grid: which rank runs which plan device, and every process group nnscaler uses.

A *unit* is `plan_ngpus` consecutive ranks holding one whole copy of the model; rank `r` runs
plan device `r % plan_ngpus` in unit (= data-parallel rank) `r // plan_ngpus`. Ranks with the same
plan device hold identical shards and form the gradient-sync group.

This module is the only place in a training job that calls `torch.distributed.new_group`, and
its registry is the only cache of groups (the collectives of `comm` look groups up here on every
call). Groups are cached by their (sorted) rank tuple, so two grids or two callers asking for
the same ranks share one group. (The autodist profiler, `nnscaler.policies.autodist.comm_profile`,
makes groups in processes of its own, with a default group of its own that it destroys: it is
below the runtime and may not import it, and none of its groups outlive its measurement.) `new_group` is collective over the default group:
every rank must ask for the same groups in the same order, including ranks that are not members.
`RankGrid` does that for its own groups (all sync groups by plan device, then all unit groups by
unit index); callers of `RankGrid.group()` must do the same.

The registry belongs to the default process group it was built under: when that group is
destroyed (`dist.destroy_process_group()`, which destroys every group) or replaced, the next
`RankGrid.get()` / `group()` call notices and starts afresh. `RankGrid.destroy_all()` destroys the
groups created here and empties the registry while the default group stays up.

Without a process group (or with world size 1) nothing distributed is called: the groups of a
single rank are `None` (meaning "just this process"), or the default group when one exists.
"""
from __future__ import annotations

import atexit
import gc
from datetime import timedelta
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .device import is_distributed
from nnscaler.ir import ComputeConfig

from .errors import ConfigError

__all__ = ["RankGrid", "process_group", "default_timeout"]

_GRIDS: Dict[Tuple[int, int], "RankGrid"] = {}
_GROUPS: Dict[Tuple[int, ...], object] = {}
_OWNER: Optional[object] = None  # the default group the registry was built under (None: no dist)


def _release_at_exit() -> None:
    """Drop the registry's references before the interpreter finalizes: a process group object
    (and the gloo threads it owns) must not be destroyed during finalization or after it."""
    global _OWNER
    _GRIDS.clear()
    _GROUPS.clear()
    _OWNER = None
    gc.collect()


atexit.register(_release_at_exit)


def _world() -> Tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without a process group."""
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_owner() -> None:
    """Forget every cached grid and group if the default process group changed or went away."""
    global _OWNER
    current = dist.group.WORLD if is_distributed() else None
    if current is not _OWNER:
        # The old default group is gone (destroy_process_group() destroys every group with it)
        # or there was none: the cached groups are dead, only drop the references.
        _GRIDS.clear()
        _GROUPS.clear()
        _OWNER = current


def process_group(ranks: Iterable[int], create: bool = True):
    """The process group of `ranks` (any order): the default group for the whole world, `None`
    without a process group. A missing group is created when `create` (COLLECTIVE over the
    default group: every rank, member or not, asks for the same sets in the same order); with
    ``create=False`` a missing group raises LookupError."""
    _check_owner()
    key = tuple(sorted({int(r) for r in ranks}))
    _, world = _world()
    if key == tuple(range(world)):
        return dist.group.WORLD if is_distributed() else None
    if key not in _GROUPS:
        if not create:
            raise LookupError(f"no process group exists yet for ranks {key}")
        _GROUPS[key] = dist.new_group(list(key), timeout=default_timeout())
    return _GROUPS[key]


def default_timeout() -> timedelta:
    """The timeout of the default process group (``init_process_group(..., timeout=...)``; the
    Trainer sets it from ``collective_timeout``). Every group created here gets it (torch's
    `new_group` would otherwise take the backend's default, 30 minutes for gloo), and the waits of
    failures/ give up after it. torch keeps the value only in the backend's options
    (``options._timeout``, checked on torch 2.6 to 2.13); the backend's default when unreadable."""
    group = dist.group.WORLD
    for device in getattr(group, "_device_types", None) or (torch.device("cpu"),):
        try:
            timeout = group._get_backend(device).options._timeout
        except Exception:  # noqa: BLE001 - a backend without options (mpi, a custom one)
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return dist.distributed_c10d._get_default_timeout(dist.get_backend())


class RankGrid:
    """The rank layout of one (plan_ngpus, runtime_ngpus) pair and its process groups.

    Get one with `RankGrid.get(plan_ngpus, runtime_ngpus)` (cached; collective the first time
    when the world has more than one rank).
    """

    def __init__(self, plan_ngpus: int, runtime_ngpus: int):
        ComputeConfig(plan_ngpus, runtime_ngpus)  # the values themselves are validated there, once
        rank, world = _world()
        if not is_distributed() and runtime_ngpus > 1:
            raise ConfigError(
                f"ComputeConfig.runtime_ngpus is {runtime_ngpus} but torch.distributed is not "
                f"initialized in this process: launch {runtime_ngpus} processes (e.g. `torchrun "
                f"--nproc_per_node={runtime_ngpus} train.py`) and call "
                f"torch.distributed.init_process_group() before building the module.")
        if world != runtime_ngpus:
            raise ConfigError(
                f"ComputeConfig.runtime_ngpus is {runtime_ngpus} but the torch.distributed world "
                f"size is {world}: launch {runtime_ngpus} processes, or set runtime_ngpus={world} "
                f"(a multiple of plan_ngpus={plan_ngpus}).")
        self.plan_ngpus = plan_ngpus
        self.runtime_ngpus = runtime_ngpus
        self.rank = rank
        self.dp_size = runtime_ngpus // plan_ngpus
        self.dp_rank = rank // plan_ngpus
        self.plan_device = rank % plan_ngpus
        self.sync_ranks: Tuple[int, ...] = self.sync_ranks_of(self.plan_device)
        self.unit_ranks: Tuple[int, ...] = self.unit_ranks_of(self.dp_rank)
        # new_group is collective: every rank creates every set, in this order.
        groups = [self.group(self.sync_ranks_of(d)) for d in range(plan_ngpus)]
        self.sync_group = groups[self.plan_device]
        groups = [self.group(self.unit_ranks_of(u)) for u in range(self.dp_size)]
        self.unit_group = groups[self.dp_rank]

    # -- registry -------------------------------------------------------------------------------
    @classmethod
    def get(cls, plan_ngpus: int, runtime_ngpus: int) -> "RankGrid":
        """The cached grid of (plan_ngpus, runtime_ngpus); built (collectively) on first use."""
        _check_owner()
        key = (plan_ngpus, runtime_ngpus)
        if key not in _GRIDS:
            _GRIDS[key] = cls(plan_ngpus, runtime_ngpus)
        return _GRIDS[key]

    @staticmethod
    def destroy_all() -> None:
        """Destroy every group created here (never the default group) and empty the registry.

        Call it on every rank before `destroy_process_group()` when tearing down early; after
        `destroy_process_group()` it is not needed (the registry notices and starts afresh).
        """
        global _OWNER
        if is_distributed() and dist.group.WORLD is _OWNER:
            for group in _GROUPS.values():
                if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(group)
        _GRIDS.clear()
        _GROUPS.clear()
        _OWNER = None

    # -- layout ---------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.runtime_ngpus

    def sync_ranks_of(self, plan_device: int) -> Tuple[int, ...]:
        """The ranks that run `plan_device` (one per unit): they sync gradients."""
        return tuple(range(plan_device, self.runtime_ngpus, self.plan_ngpus))

    def unit_ranks_of(self, dp_rank: int) -> Tuple[int, ...]:
        """The `plan_ngpus` consecutive ranks of unit `dp_rank`."""
        return tuple(range(dp_rank * self.plan_ngpus, (dp_rank + 1) * self.plan_ngpus))

    def group(self, ranks: Iterable[int]):
        """The process group of `ranks` (any order; duplicates ignored), created on first use.

        COLLECTIVE on first use of a rank set: every rank of the default group must call it with
        the same ranks in the same order, members or not (non-members get
        `dist.GroupMember.NON_GROUP_MEMBER`). The full world gives the default group; a single
        rank without a process group gives `None`.
        """
        key = tuple(sorted({int(r) for r in ranks}))
        if not key or key[0] < 0 or key[-1] >= self.runtime_ngpus:
            raise ValueError(f"ranks {list(key)} must be a non-empty subset of 0..{self.runtime_ngpus - 1}")
        return process_group(key)

    def group_of(self, rank_sets: Sequence[Iterable[int]]):
        """Create the groups of all `rank_sets` in order (collective) and return
        `(ranks, group)` of the set that contains this rank (`(None, None)` if none does).
        For partitions of the unit such as tensor-parallel sub-groups."""
        mine: Tuple[Optional[Tuple[int, ...]], object] = (None, None)
        for ranks in rank_sets:
            key = tuple(sorted({int(r) for r in ranks}))
            group = self.group(key)
            if self.rank in key:
                mine = (key, group)
        return mine

    def __repr__(self) -> str:
        return (f"RankGrid(plan_ngpus={self.plan_ngpus}, runtime_ngpus={self.runtime_ngpus}, "
                f"rank={self.rank}, plan_device={self.plan_device}, dp_rank={self.dp_rank})")
