"""Gradient synchronisation of a pipelined ParallelModule.

A pipeline step accumulates gradients over its micro-batches and synchronises them once, at the
end: the data-parallel reducer, plus one reducer per group of pipeline devices that hold the same
tensor (a tied weight used by two stages, a Chimera stage's weights), which sums their gradients.
`no_sync()` on the module (or the process-wide `sync_grad_when(False)`) pauses that sync
(gradient accumulation over steps).
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List

import torch

from .reducer import Pausable, Reducer, pausable

__all__ = ["PipelineGradSync", "zero3_cross_groups"]


def zero3_cross_groups(module) -> Dict[str, Any]:
    """use_zero=3: local name -> (holders, group) of each tensor several pipeline devices hold (a tied
    embedding and head): the group joins this rank with the same data-parallel unit on the other
    holders, whose shards hold the same elements; their shard gradients are summed at the step
    (`zero3.FullyShardedParams.sum_shared`). Creates every such group on every rank, in one order
    (collective)."""
    meta, grid = module.PIPELINE, module.grid
    if meta is None or not meta.shared:
        return {}
    n, unit = grid.plan_ngpus, grid.rank // grid.plan_ngpus
    mine = {}
    for holders in meta.shared_groups:
        for u in range(grid.dp_size):
            group = grid.group([u * n + d for d in holders])
            if grid.plan_device in holders and u == unit:
                mine[tuple(holders)] = group
    index = grid.plan_device % meta.tp_size
    out = {}
    for local, entry in module.fullmap.items():
        holders = meta.shared.get(entry.full_name)
        tensor, _ = module.local_tensor(local)
        if holders and isinstance(tensor, torch.nn.Parameter):
            out[local] = (tuple(holders[index]), mine[tuple(holders[index])])
    return out


class PipelineGradSync(Pausable):
    """The end-of-step gradient sync of one pipelined module."""

    def __init__(self, module, training: bool, bucket_cap_mb):
        self.module = module
        self.reducers: List[Reducer] = []  # pipeline devices holding one tensor: sum their grads
        self._synced = False
        sharded = module.compute_config.zero_stage == 3  # use_zero=3 sums them itself (zero3_cross_groups)
        for group, params in self._shared_param_groups().items():
            if params and training and not sharded:
                self.reducers.append(Reducer(params, group=group, bucket_cap_mb=bucket_cap_mb,
                                             divisor=module.grid.dp_size))
        pausable(self)

    def shared_parameters(self) -> set:
        """ids of the parameters the shared reducers sync (the data-parallel reducer skips them)."""
        return {id(p) for r in self.reducers for bucket in r.buckets for p in bucket}

    def _shared_param_groups(self) -> Dict[Any, List[torch.nn.Parameter]]:
        """Process group -> this rank's parameters that several pipeline devices hold. Creates
        every such group on every rank, in the same order (collective)."""
        module = self.module
        meta, grid = module.PIPELINE, module.grid
        n, units = grid.plan_ngpus, range(grid.dp_size)
        groups = {}
        for holders in meta.shared_groups:
            ranks = tuple(sorted(u * n + d for u in units for d in holders))
            group = grid.group(ranks)
            if grid.plan_device in holders:
                groups[tuple(holders)] = group
        by_group: Dict[Any, List[torch.nn.Parameter]] = {g: [] for g in groups.values()}
        index = grid.plan_device % meta.tp_size
        for local, entry in module.fullmap.items():
            holders = meta.shared.get(entry.full_name)
            tensor, _ = module.local_tensor(local)
            if holders and isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
                by_group[groups[tuple(holders[index])]].append(tensor)
        return by_group

    # -- per step ---------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        """Inside the module's ``sync_grad_when(False)``."""
        return not self.sync_enabled

    def hold(self) -> contextlib.ExitStack:
        """Inside a pipeline step: this module's reducers only accumulate (the step syncs once,
        at its end); other modules' reducers are left alone."""
        stack = contextlib.ExitStack()
        reducer = self.module.reducer
        for r in ([reducer] if reducer is not None else []) + self.reducers:
            stack.enter_context(r.no_sync())
        return stack

    def pause(self, cond: bool):
        """``sync_grad_when(cond)`` of a pipelined module."""
        return self.sync_grad_when(cond)

    def sync(self) -> None:
        """End of a pipeline step: every reducer synchronises the accumulated gradients once."""
        reducer = self.module.reducer
        for r in ([reducer] if reducer is not None else []) + self.reducers:
            r.sync_grads()
        self._synced = bool(self.reducers)

    def unshare(self) -> None:
        """Before accumulating on top of synced gradients: a tensor held by several pipeline
        devices has the same (summed) gradient on each; keep it on the first holder only, so the
        next sum counts it once (the data-parallel mean is unaffected: every unit keeps one)."""
        if not self._synced:
            return
        self._synced = False
        module = self.module
        meta, device = module.PIPELINE, module.grid.plan_device
        first = {name for name, per_index in meta.shared.items()
                 if per_index[device % meta.tp_size][0] != device}
        for local, entry in module.fullmap.items():
            tensor, _ = module.local_tensor(local)
            if entry.full_name in first and tensor.grad is not None:
                tensor.grad.zero_()
