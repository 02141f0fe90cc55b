"""ZeRO stage 1: the optimizer state (and the fp32 master copy, where there is one) of every
trainable tensor is sharded across the data-parallel replicas of that tensor.
(One file over 400 lines: the buckets, their reduction and the sharded step are one engine whose
state the three share; the fully sharded mode's unit cycle is `zero3`.)

Turned on by ``ComputeConfig(use_zero=True)``; `build_optimizer` builds it (this module holds the
machinery and the public metadata). The training loop does not change::

    opt = build_optimizer(pm, torch.optim.Adam, lr=1e-3)
    opt.zero_grad(); loss = pm(**batch); loss.backward(); opt.clip_gnorm(1.0); opt.step()

Groups
------
The ranks that run the same plan device (the gradient-sync group, one rank per unit, in unit
order) are cut into ``zero_ngroups`` contiguous *zero groups* of ``z = dp // zero_ngroups``
ranks: with sync ranks ``(s0, ..., s7)`` and ``zero_ngroups=2`` they are ``(s0..s3)`` and
``(s4..s7)``. Each zero group holds one complete, sharded copy of the optimizer state; rank ``i``
of a group owns shard ``i``. The ranks holding the same shard index in the other groups form the
*cross group* (only used when ``zero_ngroups > 1``). Plain (not parallelized) parameters of a
container module are replicated on every rank and sharded the same way over this rank's zero
group. All groups come from `RankGrid.group` and are created collectively, in one fixed order.

Flat buckets
------------
This rank's trainable tensors (each ParallelModule's, in module order, then the plain ones) are
laid out back to back in flat *buckets* of about ``reducer_bucket_cap_mb`` (closed once they reach
the cap, as the Reducer's; never mixing dtypes, devices or reduction modes). A bucket of ``numel``
elements is padded to ``padded_numel``, a multiple of ``z``; rank ``i`` owns its contiguous range
``[i * shard_numel, (i + 1) * shard_numel)``. Every rank of a zero group builds the same buckets.
Where a tensor crosses a range boundary it is split; each owned part is a *piece*.

The optimizer
-------------
The torch optimizer is built over the pieces, not over the parameters: one 1-D tensor per piece,
a view of the parameter's memory (a copy for a non-contiguous parameter), so its state exists
only for the owned elements. ``opt.state_dict()`` therefore holds only this rank's shard:
``state_dict()["state"][k]`` belongs to the piece whose ``state_index`` is ``k`` (tensors of shape
``(stop - start,)``; scalars such as Adam's ``step`` are per piece). ``load_state_dict`` expects a
state saved under the same layout (resharding is the checkpoint's job, from `ZeroShardLayout`).
A rank that owns no element at all (a tiny model) gets one empty placeholder tensor, never
stepped, so that the optimizer can be built.

fp32 master weights: ``nnscaler.runtime.precision.with_master_weights(opt)`` applied to a ZeRO
optimizer replaces the fp16/bf16 pieces in ``param_groups`` by fp32 copies of the pieces, so the
masters are sharded too (``state_dict()["master_weights"]`` is keyed by the same ``state_index``);
after the step the owned values are read from whatever tensors ``param_groups`` holds.

Only element-wise optimizers are exact under sharding (SGD, Adam, AdamW, Adagrad, RMSprop, ...);
optimizers that look at a whole tensor (LAMB, Adafactor, Shampoo) would see pieces.

Gradients
---------
The optimizer steps on *shard gradients*, the ``.grad`` of the pieces, set once per step by
`sync_shard_grad()` (the first of ``clip_gnorm``, ``scale_grads``, ``step`` or an explicit call; it
is set afresh after ``zero_grad()`` and after the step), from the parameters' accumulated
``.grad``:

* default (``zero_use_reduce_scatter=False``): the module's Reducer all-reduces (averages) the
  gradients over the whole sync group during ``backward()``, as without ZeRO; the sync copies
  each rank's owned ranges (no communication).
* ``zero_use_reduce_scatter=True``: `build_optimizer` detaches the module's Reducer (``pm.reducer``
  becomes None, ``backward()`` only accumulates locally) and the sync reduce-scatters each bucket
  (pre-divided sum) within the zero group, then, when ``zero_ngroups > 1``, all-reduces the shard
  over the cross group: each rank receives only its shard. This is done at the step rather than
  inside backward: no overlap with backward, but exactly one reduction per step however many
  backward passes accumulated into ``.grad`` (``sync_grad_when`` has nothing left to skip). A "has
  a gradient" flag per tensor travels in the same collective, so a tensor that no rank gave a
  gradient is skipped by the optimizer, as in single-device training. Plain parameters of a
  container keep their all-reduce (their Reducer), and so do tensors held by several pipeline
  stages (a tied embedding / head: their reducer sums over the holders too); ZeRO copies those.

A backward pass after the sync and before the step is not seen by that step. ``clip_gnorm`` and
``scale_grads`` act on the shard gradients; ``p.grad`` keeps what backward left (averaged by
default, the local sum with reduce-scatter). ``zero_grad()`` clears both.

After the step every zero group all-gathers its updated shards (one all-gather per bucket) and
every rank copies the full values into its parameters.

Gradient norm: squares of the shard gradients, each tensor's divided by its number of copies in
the unit (``FullMapEntry.replicas``; ``plan_ngpus`` for plain parameters), summed over the ranks
of the units of this zero group: every full gradient element counts once.

Collectives are recorded in the comm stats as ``zero_reduce_scatter``, ``zero_all_reduce`` and
``zero_all_gather`` (payload convention of `nnscaler.runtime.comm.stats`); backends without a
native reduce-scatter / all-gather take the fallbacks of `nnscaler.runtime.comm.fallbacks`.

Checkpoint metadata
-------------------
`ZeroShardLayout` (``opt.zero_layout``; ``to_dict()`` is JSON, ``from_dict()`` reads it back)
says which slice of which parameter's state lives on which rank; see its docstring. It is the
public contract: a checkpoint reader needs only these dataclasses, or just the dict.

"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import failures
from .comm.flat import all_gather_flat, reduce_scatter_rows
from .comm.stats import record
from .errors import ConfigError
from .gradients import clear_grads
from .zero_groups import ZeroGroups, make_zero_groups
from nnscaler.ir.contracts import LAYOUT_VERSION, FullMapEntry, ZeroBucket, ZeroPiece, ZeroShardLayout

__all__ = ["ZeroPiece", "ZeroBucket", "ZeroShardLayout", "LAYOUT_VERSION", "ZeroGroups", "make_zero_groups",
           "ZeroParam", "ZeroEngine", "ZeroStats", "row_segments", "held_order", "reduce_rows", "flat_layout", "owned_ranges"]



# -- the engine ---------------------------------------------------------------------------------------
@dataclass
class ZeroParam:
    """A trainable tensor handed to the engine, with the names the layout records.

    reduce: True when the engine reduces its gradient (reduce-scatter); False when it arrives
    averaged (by a Reducer during backward) or has nothing to average."""

    param: torch.nn.Parameter
    module_path: str
    parallel: bool
    entry: FullMapEntry  # where the local tensor sits in its full tensor
    reduce: bool = False


@dataclass
class ZeroStats:
    """Counters for tests and benchmarks."""

    reduce_scatter_calls: int = 0  # per bucket
    cross_all_reduce_calls: int = 0  # per bucket
    all_gather_calls: int = 0  # per bucket
    syncs: int = 0  # times the shard gradients were set (once per step)


class _Piece:
    __slots__ = ("param", "start", "stop", "shard_offset", "bucket_offset", "tensor", "index")

    def __init__(self, param: ZeroParam, start: int, stop: int, bucket_offset: int, shard_offset: int):
        self.param, self.start, self.stop = param, start, stop
        self.bucket_offset, self.shard_offset = bucket_offset, shard_offset
        self.index = -1  # position in the optimizer's param_groups (set by ZeroEngine.bind)
        p = param.param.detach()
        # a view: the optimizer updates the parameter in place (a copy for a non-contiguous one)
        self.tensor = p.view(-1)[start:stop] if p.is_contiguous() else p.reshape(-1)[start:stop].clone()

    @property
    def numel(self) -> int:
        return self.stop - self.start


def flat_layout(numels: Sequence[int], group_size: int, min_shard: int = 0) -> Tuple[List[int], int, int, int]:
    """Tensors of `numels` elements laid out back to back in one flat buffer padded to a multiple of
    `group_size`: (offsets, real elements, elements each rank owns (at least `min_shard`), padded size)."""
    offsets, numel = [], 0
    for n in numels:
        offsets.append(numel)
        numel += n
    shard = max(min_shard, -(-numel // group_size))  # ceil
    return offsets, numel, shard, shard * group_size


def owned_ranges(offsets: Sequence[int], numels: Sequence[int], shard: int, index: int
                 ) -> Iterator[Tuple[int, int, int, int, int]]:
    """The parts of a flat layout's tensors that rank `index` owns (elements ``[index*shard,
    (index+1)*shard)``): (tensor position, start, stop within the tensor, offset in the flat buffer,
    offset in the shard), for each tensor with an owned part."""
    lo, hi = index * shard, (index + 1) * shard
    for pos, (off, n) in enumerate(zip(offsets, numels)):
        a, b = max(off, lo), min(off + n, hi)
        if a < b:
            yield pos, a - off, b - off, a, a - lo


class _Bucket:
    def __init__(self, params: List[ZeroParam], group_size: int, reduce: bool):
        self.params = params
        self.offsets, self.numel, self.shard, self.padded = flat_layout([zp.param.numel() for zp in params],
                                                                        group_size)
        self.reduce = reduce  # the engine reduce-scatters this bucket (else: copies the owned ranges)
        self.pieces: List[_Piece] = []
        self.shard_grad: Optional[torch.Tensor] = None  # copied buckets: persistent buffer

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].param.dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].param.device


def reduce_rows(send: torch.Tensor, groups: ZeroGroups, *, label: str, what: str) -> torch.Tensor:
    """This rank's row of the mean over the data-parallel replicas of `send` ((zero group size)
    rows, overwritten): pre-divided by the replica count (gloo has no AVG), reduce-scattered in the
    zero group, then all-reduced over the cross group when zero_ngroups > 1. COLLECTIVE."""
    send.div_(groups.dp_size)
    if groups.size > 1:
        out = reduce_scatter_rows(send, groups.group, groups.group_index, label=label, what=what, may_overwrite=True)
    else:
        out = send[0]
    if groups.cross_group is not None:
        record("zero_all_reduce", out.nbytes)
        failures.run(dist.all_reduce, out, group=groups.cross_group, what="ZeRO's cross-group gradient all-reduce")
    return out


def held_order(optimizer: torch.optim.Optimizer, given: Sequence[torch.Tensor], setting: str) -> Dict[int, int]:
    """id(tensor) -> its position in `optimizer`'s param_groups, checked to be exactly the `given`
    tensors (the owned shards build_optimizer handed optimizer_fn)."""
    order: Dict[int, int] = {}
    for group in optimizer.param_groups:
        for t in group["params"]:
            order[id(t)] = len(order)
    expected = {id(t) for t in given}
    if set(order) != expected:
        raise ConfigError(f"build_optimizer with {setting}: optimizer_fn must optimize exactly the tensors it is "
                          f"given (the owned ZeRO shards of the parameters); it built an optimizer over "
                          f"{len(order)} tensors, {len(order.keys() & expected)} of the {len(expected)} given")
    return order


def row_segments(offset: int, numel: int, width: int) -> Iterator[Tuple[int, int, int, int]]:
    """(row, column, source offset, length) of flat range [offset, offset + numel) in rows of `width`."""
    pos, end = offset, offset + numel
    while pos < end:
        row, col = divmod(pos, width)
        length = min(end - pos, width - col)
        yield row, col, pos - offset, length
        pos += length


class ZeroEngine:
    """The sharding machinery behind a ZeRO optimizer (built by `build_optimizer`).

    `params`: the trainable tensors in layout order; `groups`: from `make_zero_groups`. Build the
    optimizer over `optimizer_params()`, then call `bind(optimizer)`. The shard gradients are set
    once per step by `sync_grads()` (see the module docstring).
    """

    def __init__(self, params: Sequence[ZeroParam], groups: ZeroGroups, bucket_cap_mb: float = 25.0):
        self.groups = groups
        self.params = list(params)
        self.stats = ZeroStats()
        self.layout: Optional[ZeroShardLayout] = None
        self._synced = False
        self._buckets = self._make_buckets(self.params, int(float(bucket_cap_mb) * 1024 * 1024))
        self.pieces: List[_Piece] = []
        for bucket in self._buckets:
            numels = [zp.param.numel() for zp in bucket.params]
            for pos, start, stop, flat, local in owned_ranges(bucket.offsets, numels, bucket.shard,
                                                              groups.group_index):
                piece = _Piece(bucket.params[pos], start, stop, flat, local)
                bucket.pieces.append(piece)
                self.pieces.append(piece)
        self._placeholder: Optional[torch.Tensor] = None
        if not self.pieces:
            self._placeholder = torch.empty(0, device=self.params[0].param.device if self.params else "cpu")

    def _make_buckets(self, params: List[ZeroParam], cap_bytes: int) -> List[_Bucket]:
        rs = self.groups.dp_size > 1

        def kind(zp: ZeroParam):
            return zp.param.dtype, zp.param.device, zp.reduce and rs

        buckets, current, size = [], [], 0
        for zp in params:
            if current and kind(zp) != kind(current[0]):
                buckets.append(_Bucket(current, self.groups.size, current[0].reduce and rs))
                current, size = [], 0
            current.append(zp)
            size += zp.param.numel() * zp.param.element_size()
            if size >= cap_bytes:  # closes once it reaches the cap, as the Reducer's buckets
                buckets.append(_Bucket(current, self.groups.size, current[0].reduce and rs))
                current, size = [], 0
        if current:
            buckets.append(_Bucket(current, self.groups.size, current[0].reduce and rs))
        return buckets

    # -- optimizer binding --------------------------------------------------------------------
    def optimizer_params(self) -> List[torch.Tensor]:
        """What the torch optimizer is built over: one tensor per owned piece (or a placeholder)."""
        return [p.tensor for p in self.pieces] if self.pieces else [self._placeholder]

    def bind(self, optimizer: torch.optim.Optimizer) -> ZeroShardLayout:
        """Check that `optimizer` holds exactly the pieces and record the layout."""
        order = held_order(optimizer, self.optimizer_params(), "use_zero=True")
        g = self.groups
        buckets = tuple(ZeroBucket(b.numel, b.padded, b.shard, str(b.dtype).replace("torch.", ""), b.reduce,
                                   tuple((zp.module_path, zp.entry.local_name, off, zp.param.numel())
                                         for zp, off in zip(b.params, b.offsets)))
                        for b in self._buckets)
        pieces = []
        for bi, bucket in enumerate(self._buckets):
            for piece in bucket.pieces:
                zp = piece.param
                piece.index = order[id(piece.tensor)]
                e = zp.entry
                pieces.append(ZeroPiece(piece.index, zp.module_path, zp.parallel, e.local_name,
                                        e.full_name, tuple(e.full_shape), tuple(tuple(s) for s in e.slices),
                                        tuple(e.value_split), int(e.replicas), tuple(zp.param.shape),
                                        piece.start, piece.stop, bi, piece.bucket_offset))
        self.layout = ZeroShardLayout(**g.geometry(), version=LAYOUT_VERSION,
                                      reduce_scatter=any(b.reduce for b in self._buckets), buckets=buckets,
                                      pieces=tuple(pieces))
        return self.layout

    # -- gradients ----------------------------------------------------------------------------
    @property
    def synced(self) -> bool:
        """Whether the shard gradients are set for the coming step."""
        return self._synced

    def sync_grads(self) -> None:
        """Set the shard gradients (``.grad`` of the pieces) from the parameters' gradients, once
        per step (again after `zero_grad` or the step). COLLECTIVE over the zero (and cross)
        group when there are reduce-scatter buckets."""
        if self._synced:
            return
        with torch.no_grad():
            for bucket in self._buckets:
                if bucket.reduce:
                    self._reduce_bucket(bucket)
                else:
                    self._copy_bucket(bucket)
        self._synced = True
        self.stats.syncs += 1

    def _copy_bucket(self, bucket: _Bucket) -> None:
        """Gradients already averaged (or nothing to average): copy the owned ranges."""
        if bucket.shard_grad is None:
            bucket.shard_grad = torch.zeros(bucket.shard, dtype=bucket.dtype, device=bucket.device)
        for piece in bucket.pieces:
            grad = piece.param.param.grad
            if grad is None:
                piece.tensor.grad = None
                continue
            view = bucket.shard_grad[piece.shard_offset:piece.shard_offset + piece.numel]
            view.copy_(grad.reshape(-1)[piece.start:piece.stop])
            piece.tensor.grad = view

    def _reduce_bucket(self, bucket: _Bucket) -> None:
        """Reduce-scatter the bucket's local gradients: (group size) rows, each this rank's part of
        one shard followed by one "has a gradient" flag per tensor."""
        g, width = self.groups, bucket.shard
        send = torch.zeros(g.size, width + len(bucket.params), dtype=bucket.dtype, device=bucket.device)
        missing = False
        for j, (zp, off) in enumerate(zip(bucket.params, bucket.offsets)):
            grad = zp.param.grad
            if grad is None:
                missing = True
                continue
            send[:, width + j] = 1
            src = grad.reshape(-1)
            for row, col, s0, length in row_segments(off, zp.param.numel(), width):
                send[row, col:col + length].copy_(src[s0:s0 + length])
        out = reduce_rows(send, g, label="zero_reduce_scatter", what="ZeRO's gradient reduce-scatter")
        self.stats.reduce_scatter_calls += g.size > 1
        self.stats.cross_all_reduce_calls += g.cross_group is not None
        used = None
        if missing:  # read the flags back (a device sync on CUDA) only when a local gradient is missing
            used = {id(zp) for zp, flag in zip(bucket.params, out[width:].tolist()) if flag > 0}
        for piece in bucket.pieces:
            if used is not None and id(piece.param) not in used:
                piece.tensor.grad = None
            else:
                piece.tensor.grad = out[piece.shard_offset:piece.shard_offset + piece.numel]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' and the pieces' gradients (the optimizer clears those of the
        tensors it holds); the next `sync_grads` sets the shard gradients afresh."""
        clear_grads([zp.param for zp in self.params] + [p.tensor for p in self.pieces], set_to_none)
        self._synced = False

    # -- parameters ---------------------------------------------------------------------------
    def gather_params(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer step: read the owned values from the tensors `optimizer` holds
        (the pieces, or what replaced them in its param_groups, e.g. fp32 master copies),
        all-gather them within the zero group and copy the full values into every parameter.
        COLLECTIVE over the zero group."""
        held = [t for group in optimizer.param_groups for t in group["params"]]
        if self.layout is None or len(held) != len(self.optimizer_params()):
            raise ConfigError("ZeRO: the optimizer's param_groups changed after build_optimizer "
                              "(add_param_group is not supported with use_zero=True)")
        g = self.groups
        with torch.no_grad():
            for bucket in self._buckets:
                shard = torch.zeros(bucket.shard, dtype=bucket.dtype, device=bucket.device)
                for piece in bucket.pieces:
                    shard[piece.shard_offset:piece.shard_offset + piece.numel].copy_(held[piece.index])
                if g.size > 1:
                    full = self._all_gather(shard, g.group)
                    self.stats.all_gather_calls += 1
                else:
                    full = shard
                for zp, off in zip(bucket.params, bucket.offsets):
                    p = zp.param.detach()
                    p.copy_(full[off:off + p.numel()].view(p.shape))
        self._synced = False  # the next step's gradients are synced afresh

    def _all_gather(self, shard: torch.Tensor, group) -> torch.Tensor:
        return all_gather_flat(shard, group, self.groups.size, label="zero_all_gather",
                               what="ZeRO's parameter all-gather")

    def __repr__(self) -> str:
        g = self.groups
        return (f"ZeroEngine({len(self.params)} tensors, {len(self._buckets)} buckets, {len(self.pieces)} pieces, "
                f"group={g.group_ranks}, index={g.group_index}, ngroups={g.ngroups})")
