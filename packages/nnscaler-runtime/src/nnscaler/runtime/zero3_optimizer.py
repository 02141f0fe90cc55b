"""The optimizer's side of fully sharded data parallelism (``use_zero=3``): `build_optimizer`
builds the torch optimizer over *pieces*, 1-D views of the units' shards, one per tensor range
this rank owns, exactly as ZeRO stage 1 does over its buckets (see `nnscaler.runtime.zero`), so
``opt.zero_layout`` is the same `ZeroShardLayout` record and checkpoints read both stages alike.

The optimizer updates the shards in place; the next forward gathers the new values (there is no
all-gather after the step, unlike stage 1). Gradients: backward reduce-scatters each unit into
its shard's gradient (`nnscaler.runtime.zero3`); `sync_grads` reduces what was accumulated under
``no_sync`` and points every piece's ``.grad`` at its range of the shard gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .errors import ConfigError
from .zero import ZeroStats, held_order, owned_ranges
from .zero3 import FullyShardedParams, ShardUnit
from .zero3_shared import sum_shared
from nnscaler.ir.contracts import LAYOUT_VERSION, FullMapEntry, ZeroBucket, ZeroPiece, ZeroShardLayout

__all__ = ["FullyShardedOptimizerState"]


@dataclass
class _Piece:
    """Elements [start, stop) of tensor `position` of `unit`, at `shard_offset` in its shard."""

    module_path: str
    unit: ShardUnit
    position: int
    entry: FullMapEntry
    start: int
    stop: int
    bucket: int
    bucket_offset: int
    shard_offset: int
    tensor: torch.Tensor
    index: int = -1

    @property
    def numel(self) -> int:
        return self.stop - self.start


class FullyShardedOptimizerState:
    """What `build_optimizer` keeps for a fully sharded module: the pieces the optimizer holds,
    the layout record, and the once-per-step gradient hand-over (the interface of
    `nnscaler.runtime.zero.ZeroEngine`)."""

    owns_storage = True  # the pieces are the only copy of the parameters' values

    def __init__(self, modules: List[Tuple[str, "object"]]):
        """`modules`: (path in the optimizer's module, ParallelModule) with `fully_sharded` set."""
        self.engines: List[FullyShardedParams] = [pm.fully_sharded for _, pm in modules]
        self.groups = self.engines[0].groups
        self.stats = ZeroStats()
        self.layout: Optional[ZeroShardLayout] = None
        self._synced = False
        self._buckets: List[ZeroBucket] = []
        self.pieces: List[_Piece] = []
        lo_index = self.groups.group_index
        for (path, pm), engine in zip(modules, self.engines):
            engine.shard()
            for u in engine.units:
                bi = len(self._buckets)
                self._buckets.append(ZeroBucket(u.numel, u.padded, u.shard_numel, str(u.dtype).replace("torch.", ""),
                                                True, tuple((path, n, o, c) for n, o, c in
                                                            zip(u.local_names, u.offsets, u.numels))))
                shard = u.shard.detach()
                for pos, start, stop, flat, local in owned_ranges(u.offsets, u.numels, u.shard_numel, lo_index):
                    if u.params[pos].requires_grad:
                        self.pieces.append(_Piece(path, u, pos, pm.fullmap[u.local_names[pos]], start, stop, bi, flat,
                                                  local, shard[local:local + stop - start]))
        self._placeholder = None if self.pieces else torch.empty(0, device=self.engines[0].units[0].device
                                                                 if self.engines[0].units else "cpu")

    # -- optimizer binding --------------------------------------------------------------------
    def optimizer_params(self) -> List[torch.Tensor]:
        return [p.tensor for p in self.pieces] if self.pieces else [self._placeholder]

    def bind(self, optimizer: torch.optim.Optimizer) -> ZeroShardLayout:
        """Check that `optimizer` holds exactly the pieces and record the layout."""
        order = held_order(optimizer, self.optimizer_params(), "use_zero=3")
        pieces = []
        for piece in self.pieces:
            piece.index = order[id(piece.tensor)]
            e = piece.entry
            pieces.append(ZeroPiece(piece.index, piece.module_path, True, e.local_name, e.full_name,
                                    tuple(e.full_shape), tuple(tuple(s) for s in e.slices), tuple(e.value_split),
                                    int(e.replicas), tuple(piece.unit.shapes[piece.position]), piece.start,
                                    piece.stop, piece.bucket, piece.bucket_offset))
        self.layout = ZeroShardLayout(**self.groups.geometry(), version=LAYOUT_VERSION, reduce_scatter=True,
                                      buckets=tuple(self._buckets), pieces=tuple(pieces))
        return self.layout

    # -- gradients ----------------------------------------------------------------------------
    @property
    def synced(self) -> bool:
        return self._synced

    def sync_grads(self) -> None:
        """Point every piece's gradient at its range of the shard gradient (None where no rank
        gave the tensor a gradient), after reducing what `no_sync` left. Once per step. Before the
        step, nothing stays gathered or in flight (`free_all`): the next forward gathers the new values."""
        for engine in self.engines:
            engine.free_all()
        if self._synced:
            return
        used = {}
        for engine in self.engines:
            engine.finish_grads()
            sum_shared(engine)  # tensors several pipeline stages hold: their gradients summed over the holders
            used.update(engine.used_flags())
        for piece in self.pieces:
            grad = piece.unit.shard.grad
            if grad is None or not used[id(piece.unit)][piece.position]:
                piece.tensor.grad = None
            else:
                piece.tensor.grad = grad[piece.shard_offset:piece.shard_offset + piece.numel]
        self._synced = True
        self.stats.syncs += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        for engine in self.engines:
            engine.zero_grad(set_to_none)
        for piece in self.pieces:
            piece.tensor.grad = None
        self._synced = False

    def gather_params(self, optimizer: torch.optim.Optimizer) -> None:
        """After the step: where the optimizer holds other tensors than the pieces (fp32 masters,
        offloaded copies), copy their values into the shards. No communication: the next forward
        gathers."""
        held = [t for group in optimizer.param_groups for t in group["params"]]
        if self.layout is None or len(held) != len(self.optimizer_params()):
            raise ConfigError("ZeRO: the optimizer's param_groups changed after build_optimizer "
                              "(add_param_group is not supported with use_zero=3)")
        with torch.no_grad():
            for piece in self.pieces:
                value = held[piece.index]
                if value is not piece.tensor:
                    piece.tensor.copy_(value)
        self._synced = False

    def __repr__(self) -> str:
        return f"FullyShardedOptimizerState({len(self._buckets)} units, {len(self.pieces)} pieces)"
