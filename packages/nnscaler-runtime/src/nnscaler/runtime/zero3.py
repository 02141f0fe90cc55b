"""Fully sharded data parallelism (ZeRO-3, ``ComputeConfig(use_zero=3)``): a ParallelModule's
parameters, their gradients and the optimizer state are sharded over the ranks of each zero group.
(One file over 400 lines: a unit's gather, prefetch, free and reduce-scatter share its state through
one cycle; the optimizer's side is `zero3_optimizer`, a tensor two stages hold `zero3_shared`.)

Units. The parameters are grouped into *units*, gathered and freed together (FSDP's wrapped
modules). Each repeated block of the model is one unit, found from the full (single-device)
names: the outermost ``<prefix>.<i>.`` whose prefix holds at least two indices (``layers.0``,
``model.layers.7``, ``h.3``), as FSDP's auto-wrap of each decoder layer; everything else is the
*root* unit (embeddings, final norm, head). ``unit_modules`` (``ComputeConfig.pas_config
["zero3_units"]``, module paths of the single-device model) names the units instead.
A unit never mixes dtypes, nor trainable and frozen tensors (``requires_grad=False``: a
frozen embedding, the base weights under LoRA adapters): one unit per dtype and per kind then, of
the same name; a frozen unit's shard needs no gradient, so it is never reduce-scattered and the
optimizer holds no piece of it.

Layout. A unit's tensors are laid out in one flat buffer in registration order, padded to a
multiple of the zero group size z; rank i of the zero group keeps elements ``[i*S, (i+1)*S)``
(``S = padded / z``) as the unit's *shard*, a leaf tensor, and the registered parameters keep no
storage (a 0-element tensor). This is the bucket layout of ZeRO stage 1 with one bucket per
unit, so `ZeroShardLayout` describes it and checkpoints of both stages read alike.

Forward. The generated code reads a parameter as ``self.<name>``; `ParallelModule.__getattr__`
hands that to `FullyShardedParams.get`, which all-gathers the unit on its first use (through the
autograd function `_GatherUnit`) and returns the gathered tensor; entering a repeated block frees
every other block and starts the all-gather of the block the first forward used after it
(prefetch: it runs while this block computes), and the end of forward frees all. The gathered
tensors that autograd saves for backward are stored as references to the unit (saved-tensor
hooks), not as tensors, so freeing really frees them; every other saved tensor with a history as a
detached alias (no cycle keeps the graph of a forward no backward follows; hence no
``create_graph=True`` backward). Outside forward and backward, a read is a
fresh all-gather nothing keeps (the current value; no stale unit for a later forward).

Backward. A freed block is gathered again when backward first unpacks one of its tensors, or when
recomputation reads it again; entering it frees every other block, and the block forward used
before it (whose backward comes next) starts gathering then (backward prefetch). So at most two
blocks and the root are gathered, in forward, backward and recomputation. The end of backward,
and the optimizer's `sync_grads` before the step, drop everything gathered or in flight. With
``pas_config["zero3_reshard_after_forward"]`` a unit stays gathered from forward to its backward
(False), or each rank keeps its 1/k part of it and backward gathers it over k ranks (an int k:
`zero3_reshard`). When
every gradient of a unit's gathered tensors is known, `_GatherUnit.backward`
reduce-scatters them in the zero group (pre-divided by the data-parallel size, then summed: the
mean over replicas; plus an all-reduce over the cross group when ``zero_ngroups > 1``), and the
shard's gradient accumulates the result; the unit is freed (a one-tensor unit, an embedding or a head:
its gradient reduce-scattered in chunks, a send copy of a sixteenth of it at most; `_reduce_scatter_alone`). Inside ``no_sync()`` (gradient
accumulation) the unit's full gradients are kept, summed, until the next synchronising backward
reduce-scatters them with its own (FSDP's ``no_sync``: one reduction per step, full-size
gradient buffers for the units meanwhile). A plain loop without ``no_sync`` reduce-scatters each
micro-batch instead (shard-size gradients only). One flag per tensor travels with the gradients,
so a tensor no rank gave a gradient keeps a None gradient, as in single-device training.

Mixed precision (FSDP2's ``MixedPrecisionPolicy``, ``pas_config["zero3_mixed_precision"]``,
`contracts.mixed_precision`, per unit): a unit is gathered (forward, backward, recomputation) in its
``param_dtype`` (the shard cast before the all-gather: half the bytes for bf16 from fp32) and its
gradients reduce-scattered in its ``reduce_dtype``, the result cast to the shard's dtype; the shards
(the optimizer's masters) keep theirs, as do `unsharded` and a read outside forward (the values).
The code was traced in ``param_dtype`` (runtime/driver/traced_precision.py).

Buffers are not sharded (they are small and read in place). Collectives are recorded in the comm
stats as ``zero3_all_gather``, ``zero3_reduce_scatter`` and ``zero_all_reduce``. (One file over 400
lines: the gather, prefetch, free and reduce-scatter of a unit share its state through one cycle;
the optimizer's side is `zero3_optimizer`.)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from . import failures
from .comm.flat import all_gather_flat, start_all_gather_flat
from .grad_ready import BackwardPass, graph_task_id
from .reducer import Pausable, pausable
from .zero import flat_layout, reduce_rows, row_segments
from .zero_groups import ZeroGroups
from .zero3_reshard import SmallerReshard
from nnscaler.ir.contracts import ROOT_UNIT, unit_names
from nnscaler.ir.contracts import MixedPrecision, UnitPrecision

__all__ = ["FullyShardedParams", "ShardUnit", "Zero3Stats", "unit_names", "ROOT_UNIT"]

@dataclass
class Zero3Stats:
    """Counters for tests and benchmarks."""

    gathers: int = 0  # unit all-gathers (forward, backward, unsharded(), reads)
    prefetched: int = 0  # of which started early, while the previous block computed
    backward_gathers: int = 0  # of which in backward (a unit freed after forward, gathered again)
    reduce_scatters: int = 0  # unit gradient reductions
    max_send_numel: int = 0  # the largest reduce-scatter send buffer of a one-tensor unit (`_reduce_scatter_alone`)
    max_gathered_numel: int = 0  # the most elements gathered at once (all units; not in unsharded())
    max_gathered_blocks: int = 0  # the most repeated blocks gathered or in flight at once (not the root)
    dropped: int = 0  # prefetches waited for but not used (a block other than the predicted one came next)
    reads: int = 0  # of which for a parameter read outside forward and backward (kept by nothing)
    max_gathered_bytes: int = 0  # the most bytes gathered at once (in the units' gather dtype: param_dtype)
    max_backward_gathered_numel: int = 0  # the most elements gathered or in flight at once inside backward


class ShardUnit:
    """One unit: its tensors' flat layout, this rank's shard and, while gathered, the whole."""

    def __init__(self, name: str, local_names: List[str], params: List[torch.nn.Parameter], group_size: int):
        self.name = name
        self.local_names = local_names
        self.params = params
        self.shapes = [tuple(p.shape) for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets, self.numel, self.shard_numel, self.padded = flat_layout(self.numels, group_size, min_shard=1)
        self.trainable = any(p.requires_grad for p in params)
        self.shard: Optional[torch.nn.Parameter] = None  # set by FullyShardedParams.shard()
        self.full: Optional[torch.Tensor] = None  # the gathered flat buffer
        self.views: Optional[Dict[str, torch.Tensor]] = None  # name -> gathered tensor (forward)
        self.pending: Optional[torch.Tensor] = None  # the send buffer summed under no_sync
        self.used: Optional[torch.Tensor] = None  # per tensor: a rank gave it a gradient this step (on the device)
        self.cross: Optional[Tuple[tuple, object]] = None  # several pipeline stages hold it: (holders, group)
        self.precision = UnitPrecision()  # FSDP2's MixedPrecisionPolicy for this unit (contracts.mixed_precision)

    @property
    def dtype(self) -> torch.dtype:
        return (self.shard if self.shard is not None else self.params[0]).dtype

    @property
    def device(self) -> torch.device:
        return (self.shard if self.shard is not None else self.params[0]).device

    @property
    def is_root(self) -> bool:
        return self.name == ROOT_UNIT

    def compute_shard(self) -> torch.Tensor:
        """The shard as it is gathered for forward and backward: in the unit's ``param_dtype``."""
        shard = self.shard.detach()
        return shard.to(self.precision.gather_dtype(shard.dtype))

    def flat_views(self, full: torch.Tensor) -> List[torch.Tensor]:
        return [full[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def __repr__(self) -> str:
        return f"ShardUnit({self.name or '<root>'!r}, {len(self.params)} tensors, {self.numel} elements)"


@dataclass
class _Saved:
    """A gathered tensor autograd saved for backward, stored as where it sits in its unit."""

    unit: ShardUnit
    size: torch.Size
    stride: Tuple[int, ...]
    offset: int


class _GatherUnit(torch.autograd.Function):
    """shard -> the unit's gathered tensors; backward reduce-scatters their gradients."""

    @staticmethod
    def forward(ctx, shard, engine, unit, keep=True):
        ctx.set_materialize_grads(False)
        ctx.engine, ctx.unit = engine, unit
        full = engine._gather(unit) if keep else engine._gather_once(unit)
        return tuple(unit.flat_views(full))

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            from nnscaler.ir import NnScalerError
            raise NnScalerError("backward(create_graph=True) (higher-order gradients) through a use_zero=3 module is "
                                "not supported: its saved tensors are kept without their history; use use_zero=0 or 1")
        return ctx.engine._reduce(ctx.unit, grads), None, None, None


def _column_chunks(z: int, width: int) -> List[Tuple[int, int]]:
    """The column ranges a one-tensor unit's gradient is reduce-scattered in: by the layout alone (the
    same calls on every rank), at most `_MAX_CHUNKS`, none under `_MIN_CHUNK_NUMEL` elements (z rows)."""
    n = max(1, min(_MAX_CHUNKS, (z * width) // _MIN_CHUNK_NUMEL))
    step = -(-width // n)
    return [(c0, min(c0 + step, width)) for c0 in range(0, width, step)]


_MAX_CHUNKS = 16
_MIN_CHUNK_NUMEL = 1 << 20


def _empty(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=like.dtype, device=like.device)


class FullyShardedParams(Pausable):
    """The fully sharded parameters of one ParallelModule (`pm.fully_sharded`).

    `shard()` (run by the first forward or `build_optimizer`) moves every parameter into its
    unit's shard; `get(name)` is what ``self.<name>`` returns in forward; `unsharded()` puts the
    whole local values back into the registered parameters for a while (checkpoints). Inside
    ``no_sync()`` (`Pausable`) the units' full gradients are kept, summed, instead of reduced; the
    next synchronising backward (or `finish_grads`) reduce-scatters the sum."""

    def __init__(self, params: Sequence[Tuple[str, str, torch.nn.Parameter]], groups: ZeroGroups,
                 unit_modules: Sequence[str] = (), shared: Optional[Dict[str, Tuple[tuple, object]]] = None,
                 edges: Sequence[str] = (), keep: Sequence[str] = (), smaller: Optional[SmallerReshard] = None):
        """`params`: (local name, full name, parameter) in registration order. `shared`: local name ->
        (holders, group) of tensors several pipeline stages hold (`pipeline_grads.zero3_cross_groups`):
        they form root units of their own, the same on every holder (by full name), whose shard
        gradients are summed over the holders at the step (`zero3_shared`). `edges`: the units of
        `unit_modules` outside the blocks (`contracts.root_modules`: embeddings, head), which backward
        does not prefetch. `keep`: the units (by name) not freed after forward (FSDP2's
        ``reshard_after_forward=False``): gathered until their backward reduce-scatters (or backward
        ends), so backward gathers them no more. `smaller`: the units resharded to a smaller group after
        forward (FSDP2's ``reshard_after_forward=k``, `zero3_reshard`): each rank keeps its 1/k part of
        them, and backward gathers them from the parts over k ranks."""
        self.groups = groups
        shared = shared or {}
        names = unit_names([full for _, full, _ in params], unit_modules)
        params = sorted(params, key=lambda x: (x[0] in shared, x[1] if x[0] in shared else ""))  # stable
        # a unit's frozen tensors are a unit of their own: no gradient, no reduce-scatter, no optimizer state
        by_key: Dict[tuple, Tuple[List[str], List[torch.nn.Parameter]]] = {}
        for local, full, p in params:
            key = (names[full], p.dtype, p.requires_grad) if local not in shared else (
                ROOT_UNIT, p.dtype, p.requires_grad, shared[local][0])
            locals_, ps = by_key.setdefault(key, ([], []))
            locals_.append(local)
            ps.append(p)
        self.units = [ShardUnit(key[0], ls, ps, groups.size) for key, (ls, ps) in by_key.items()]
        for u in self.units:
            u.cross = shared.get(u.local_names[0])  # (holders, group) of a unit several stages hold
        self.unit_of: Dict[str, ShardUnit] = {n: u for u in self.units for n in u.local_names}
        self.stats = Zero3Stats()
        self.sharded = False
        self._unsharded = 0
        self._forward_depth = 0  # inside forward_scope
        self._live: Dict[int, ShardUnit] = {}  # storage address of a gathered buffer -> its unit
        self._pass = BackwardPass(lambda: self.sync_enabled, self._end_of_backward)  # grad_ready.py
        self._order: List[ShardUnit] = []  # repeated blocks in the order the first forward used them
        self._next: Dict[int, ShardUnit] = {}  # id(block) -> the block forward uses after it
        self._prev: Dict[int, ShardUnit] = {}  # id(block) -> the block forward used before it
        self._edges = set(edges)  # units backward does not prefetch (contracts.root_modules: embeddings, head)
        self._keep = set(keep)  # units kept gathered from forward to their backward (reshard_after_forward=False)
        self._deferred: Optional[Tuple[ShardUnit, ShardUnit]] = None  # (unit, the prefetch its reduction starts)
        # the units resharded to a smaller group after forward (reshard_after_forward=k): their parts, `stats`
        self.smaller = smaller if smaller is not None else SmallerReshard({}, {})
        self._inflight: Optional[Tuple[ShardUnit, object, torch.Tensor]] = None  # a prefetch
        pausable(self)

    def set_precision(self, policy: MixedPrecision, pipelined: bool = False) -> None:
        """Each unit's dtypes from `policy` (FSDP2's ``MixedPrecisionPolicy``): gathered and computed in
        ``param_dtype``, gradients reduce-scattered in ``reduce_dtype``; the shards keep theirs. Per-unit
        entries are refused for a pipeline stage (`pipelined`): a stage names its units from the
        parameters it holds, not as the trace did (the whole model), so an entry could miss."""
        if pipelined and policy.units:
            from nnscaler.ir import ConfigError
            raise ConfigError(f"pas_config['zero3_mixed_precision']['units'] ({', '.join(g for g, _ in policy.units)}) "
                              f"is not supported under a pipeline: a stage's units are named from the parameters "
                              f"it holds; give one policy for every unit (param_dtype / reduce_dtype only)")
        for u in self.units:
            u.precision = policy.for_unit(u.name)

    # -- sharding -------------------------------------------------------------------------------
    def shard(self, device: Optional[torch.device] = None) -> None:
        """Keep only this rank's shard of every unit (once; the registered parameters then hold no
        storage). A unit whose parameters are on the meta device (a module built on meta) gets a
        zero shard on `device` and nothing else is allocated: its values are written into the
        shards afterwards (runtime/driver/meta_init.py, nnscaler.ckpt.load)."""
        if self.sharded:
            return
        i = self.groups.group_index
        with torch.no_grad():
            for u in self.units:
                if u.params[0].is_meta:
                    own = torch.zeros(u.shard_numel, dtype=u.dtype, device=device)
                else:
                    flat = torch.zeros(u.padded, dtype=u.dtype, device=u.device)
                    for p, view in zip(u.params, u.flat_views(flat)):
                        view.copy_(p)
                    own = flat[i * u.shard_numel:(i + 1) * u.shard_numel].clone()
                u.shard = torch.nn.Parameter(own, requires_grad=u.trainable)
                u.used = torch.zeros(len(u.params), dtype=torch.bool, device=u.device)
                for p in u.params:
                    if p.is_meta:  # another device: swapped in place (the module keeps the same Parameter)
                        torch.utils.swap_tensors(p, torch.nn.Parameter(_empty(own), requires_grad=p.requires_grad))
                    else:
                        p.data = _empty(p)
        self.sharded = True

    def apply(self, fn) -> None:
        """`Module._apply`'s `fn` (``.to(dtype)``, ``.cuda()``, ...) on the shards too."""
        if not self.sharded:
            return
        with torch.no_grad():
            for u in self.units:
                u.shard.data = fn(u.shard.data)
                u.used = u.used.to(u.shard.device)
                for p in u.params:
                    p.data = _empty(u.shard)

    def redirects(self, name: str) -> bool:
        """Whether ``self.<name>`` of the module must come from `get` (a sharded parameter now)."""
        return self.sharded and not self._unsharded and name in self.unit_of

    # -- forward --------------------------------------------------------------------------------
    def get(self, name: str) -> torch.Tensor:
        """What ``self.<name>`` is while sharded: in forward the gathered parameter (its unit gathered on
        first use, kept until forward leaves the block); in backward the same for a recomputed block; outside
        both a fresh all-gather that nothing keeps (the current value even between backward and step)."""
        u = self.unit_of[name]
        if self._forward_depth:
            return self._use(u, name, backward=False)
        if graph_task_id() != -1:  # recomputation inside backward
            self._pass.enter()
            return self._use(u, name, backward=True)
        self._land(None)
        return dict(zip(u.local_names, _GatherUnit.apply(u.shard, self, u, False)))[name]

    def _use(self, u: ShardUnit, name: str, backward: bool) -> torch.Tensor:
        """`u`'s gathered tensor `name`; entering a block frees every other one and prefetches the block
        that runs next: in forward the one after it, in backward (recomputation) the one before it."""
        if u.views is None:
            if not u.is_root:
                self._enter(u)
                if not backward and not self._next and u not in self._order:
                    self._order.append(u)
            u.views = dict(zip(u.local_names, _GatherUnit.apply(u.shard, self, u)))
            self.stats.backward_gathers += backward
            if not u.is_root:
                self._prefetch_in_backward(u) if backward else self._prefetch(self._next.get(id(u)))
        return u.views[name]

    def _enter(self, u: ShardUnit) -> None:
        """Free every gathered block but `u`'s (whatever uses them again gathers them again; a block's
        frozen and trainable tensors, or tensors of two dtypes, are units of the same name)."""
        for x in self.units:
            if x.name != u.name and not x.is_root and x.full is not None and x.name not in self._keep:
                self._free(x, reshard=True)

    def _before(self, u: ShardUnit) -> Optional[ShardUnit]:
        """The block forward used before `u`, which backward runs next; None for an edge unit (an
        embedding: its backward reads the indices, not the weight)."""
        before = self._prev.get(id(u))
        return None if before is None or before.name in self._edges else before

    def _prefetch(self, u: Optional[ShardUnit]) -> None:
        """Start the all-gather of `u` now, so that it runs while the current block computes
        (every rank issues it at the same point: the order comes from the first forward)."""
        g = self.groups
        if u is None or g.size == 1 or u.full is not None or self._inflight is not None:
            return
        started = (self.smaller.start(u) if self.smaller.holds(u) else
                   start_all_gather_flat(u.compute_shard(), g.group, g.size, label="zero3_all_gather"))
        if started is not None:
            self._inflight = (u, *started)
            self._count()

    def _prefetch_in_backward(self, u: ShardUnit) -> None:
        """Start gathering the block before `u` (backward runs it next) now, or, when `u` is larger than
        that block (an output head), once `u`'s gradient is reduce-scattered (`_reduce`): the head's
        gathered weight and full gradient are a step's largest transient, and a block gathered beside
        them would add to the step's peak (one block's gather a step is then not overlapped)."""
        before = self._before(u)
        if before is not None and u.numel > before.numel:
            self._deferred = (u, before)
        else:
            self._prefetch(before)

    def _land(self, u: Optional[ShardUnit]) -> Optional[torch.Tensor]:
        """Wait for the prefetch in flight; it is held if it was for `u` or `u` is the root (the block
        comes next), dropped otherwise (None: drop it). Its buffer if it was `u`'s."""
        if self._inflight is None:
            return None
        unit, work, full = self._inflight
        self._inflight = None
        failures.wait(work, "the fully sharded parameter all-gather (prefetch)", self.groups.group, full)
        if u is None or (unit is not u and not u.is_root):
            self.stats.dropped += 1
            return None
        self._hold(unit, full)
        self.stats.prefetched += 1
        return full if unit is u else None

    @contextlib.contextmanager
    def forward_scope(self) -> Iterator[None]:
        """Around the generated forward: gathered tensors saved for backward are stored as
        references; every unit is freed at the end."""
        self.shard()
        self._forward_depth += 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._forward_depth -= 1
            self._after_forward()
            if not self._next and len(self._order) > 1:
                self._next = {id(a): b for a, b in zip(self._order, self._order[1:])}
                self._prev = {id(b): a for a, b in zip(self._order, self._order[1:])}

    def _after_forward(self) -> None:
        """Free every unit but those kept for backward (`keep`: only when a backward will come)."""
        if not (self._keep or self.smaller) or not torch.is_grad_enabled():
            self.free_all()
            return
        self._land(None)
        for u in self.units:
            if u.name not in self._keep:
                self._free(u, reshard=True)

    def free_all(self) -> None:
        """Drop every gathered unit and a prefetch still in flight (waited for: nothing crosses)."""
        self._deferred = None
        self._land(None)
        for u in self.units:
            self._free(u)

    def _free(self, u: ShardUnit, reshard: bool = False) -> None:
        """Drop `u`'s gathered buffer; with `reshard` (forward leaving it) a unit resharded to a smaller
        group keeps its part, otherwise the part goes too."""
        if reshard and u.full is not None:
            self.smaller.keep(u, u.full)
        elif not reshard:
            self.smaller.drop(u)
        if u.full is not None:
            self._live.pop(u.full.untyped_storage().data_ptr(), None)
        u.full = None
        u.views = None

    def _gather(self, u: ShardUnit, whole: bool = False) -> torch.Tensor:
        """All-gather `u` into `u.full` (a fresh contiguous buffer, in its ``param_dtype``; `whole`: in the
        shard's dtype, the values themselves, for `unsharded`); COLLECTIVE over the zero group."""
        g = self.groups
        self._land(u)  # a prefetch in flight: for `u`, or for another unit, then held for later
        if u.full is not None:
            return u.full
        shard = u.shard.detach() if whole else u.compute_shard()
        if self.smaller.holds(u):  # resharded to a smaller group after forward: gathered from the parts there
            full = self.smaller.gather(u)
        else:
            full = all_gather_flat(shard, g.group, g.size, label="zero3_all_gather",
                                   what="the fully sharded parameter all-gather") if g.size > 1 else shard.clone()
        self._hold(u, full)
        return full

    def _gather_once(self, u: ShardUnit) -> torch.Tensor:
        """A fresh all-gather of `u` that the engine does not keep (a read outside forward)."""
        g = self.groups
        self.stats.gathers += 1
        self.stats.reads += 1
        if g.size == 1:
            return u.shard.detach().clone()
        return all_gather_flat(u.shard.detach(), g.group, g.size, label="zero3_all_gather",
                               what="the fully sharded parameter all-gather (a read outside forward)")

    def _hold(self, u: ShardUnit, full: torch.Tensor) -> None:
        u.full = full
        self._live[full.untyped_storage().data_ptr()] = u
        self.stats.gathers += 1
        self._count()

    def _count(self) -> None:
        st = self.stats
        if self._unsharded:
            return
        held = sum(x.numel for x in self.units if x.full is not None)
        st.max_gathered_numel = max(st.max_gathered_numel, held)
        st.max_gathered_bytes = max(st.max_gathered_bytes, sum(x.full.nbytes for x in self.units if x.full is not None))
        if graph_task_id() != -1:
            flying = self._inflight[0].numel if self._inflight is not None else 0
            st.max_backward_gathered_numel = max(st.max_backward_gathered_numel, held + flying)
        blocks = {id(x) for x in self.units if x.full is not None and not x.is_root}
        if self._inflight is not None:
            blocks.add(id(self._inflight[0]))
        st.max_gathered_blocks = max(st.max_gathered_blocks, len(blocks))

    def _pack(self, t: torch.Tensor):
        """A gathered tensor as a `_Saved` reference; any other tensor with a history as a detached alias:
        a hook's packed object is held strongly by its node, so an op's output saved as itself (exp,
        softmax, ...) would be a cycle through C++ (tensor -> node -> tensor) that no collector breaks,
        keeping the whole graph of a forward no backward ever runs (a forward not under no_grad)."""
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return t
        u = self._live.get(t.untyped_storage().data_ptr()) if self._live else None
        if u is None:
            return t.detach() if t.grad_fn is not None else t
        return _Saved(u, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        u = saved.unit
        if u.full is not None and u.name in self._keep and graph_task_id() != -1:
            self._pass.enter()  # kept from forward: whatever is left is freed when backward ends
        if u.full is None:
            if graph_task_id() != -1:
                self._pass.enter()
            if not u.is_root:
                self._enter(u)
            self._gather(u)
            self.stats.backward_gathers += 1
            if not u.is_root:  # backward runs the blocks in reverse: start the one before
                self._prefetch_in_backward(u)
        return u.full.as_strided(saved.size, saved.stride, saved.offset)

    def _end_of_backward(self, sync: bool, reduce: bool) -> None:
        """Whatever backward gathered or prefetched is dropped when the backward pass ends."""
        self.free_all()

    # -- backward -------------------------------------------------------------------------------
    def _reduce(self, u: ShardUnit, grads) -> Optional[torch.Tensor]:
        """The shard gradient of `u` from its gathered tensors' gradients (None under no_sync); then the
        prefetch `_prefetch_in_backward` deferred to it."""
        grad = self._reduce_grads(u, grads)
        if self._deferred is not None and self._deferred[0] is u:
            before, self._deferred = self._deferred[1], None
            self._prefetch(before)
        return grad

    def _reduce_grads(self, u: ShardUnit, grads) -> Optional[torch.Tensor]:
        self._free(u)  # a later use in this backward gathers it again
        sync = self._pass.enter()  # decided once per backward pass, as the Reducer's (grad_ready.py)
        if not u.trainable:
            return None
        if sync and u.pending is None and len(u.params) == 1:
            return self._reduce_scatter_alone(u, grads[0])
        send = self._accumulate(u, grads)
        if not sync:
            u.pending = send
            return None
        return self._reduce_scatter(u, send)

    def _reduce_scatter_alone(self, u: ShardUnit, grad: Optional[torch.Tensor]) -> torch.Tensor:
        """A one-tensor unit (an embedding, an output head): its gradient is reduce-scattered in column
        chunks (`_column_chunks`, each rank's shard a column range of the rows' layout), each copied
        into a send buffer of its own, so the send copy beside the full gradient is at most a sixteenth
        of it (FSDP2 copies it whole); its "has a gradient" flag goes in a one-element reduction of
        its own. The same collectives on every rank (the chunks are the unit's layout's)."""
        z, width, dtype = self.groups.size, u.shard_numel, u.precision.reduce_in(u.dtype)
        flat = None if grad is None else grad.reshape(-1)
        out = torch.empty(width, dtype=dtype, device=u.device)
        for c0, c1 in _column_chunks(z, width):
            send = torch.zeros(z, c1 - c0, dtype=dtype, device=u.device)
            if flat is not None:
                for row in range(z):  # the padding past the unit's elements stays zero
                    lo, hi = row * width + c0, min(row * width + c1, u.numel)
                    if hi > lo:
                        send[row, :hi - lo].copy_(flat[lo:hi])
            self.stats.max_send_numel = max(self.stats.max_send_numel, send.numel())
            out[c0:c1] = reduce_rows(send, self.groups, label="zero3_reduce_scatter",
                                     what="the fully sharded gradient reduce-scatter")
            del send
        self.stats.reduce_scatters += 1
        flag = torch.full((z, 1), float(grad is not None), dtype=dtype, device=u.device)
        u.used |= reduce_rows(flag, self.groups, label="zero3_reduce_scatter",  # the same bytes in two calls
                              what="the fully sharded gradient flags' reduction") > 0
        return out.to(u.dtype)

    def _accumulate(self, u: ShardUnit, grads) -> torch.Tensor:
        """`grads` added into the unit's send buffer (the one kept under no_sync, or a new one):
        (group size) rows, row i rank i's shard of the flat gradients followed by one "has a
        gradient" flag per tensor. Written in place, in row segments: no flat staging copy."""
        width, n = u.shard_numel, len(u.params)
        send, u.pending = u.pending, None
        if send is None:
            send = torch.zeros(self.groups.size, width + n, dtype=u.precision.reduce_in(u.dtype), device=u.device)
        flags = send[:, width:]
        for j, (grad, off, numel) in enumerate(zip(grads, u.offsets, u.numels)):
            if grad is None:
                continue
            flags[:, j] = 1
            src = grad.reshape(-1)
            for row, col, s0, length in row_segments(off, numel, width):
                send[row, col:col + length].add_(src[s0:s0 + length])
        return send

    def _reduce_scatter(self, u: ShardUnit, send: torch.Tensor) -> torch.Tensor:
        width = u.shard_numel
        out = reduce_rows(send, self.groups, label="zero3_reduce_scatter",
                          what="the fully sharded gradient reduce-scatter")
        self.stats.reduce_scatters += 1
        u.used |= out[width:] > 0  # on the device: read once per step (used_flags), no host sync here
        return out[:width].to(u.dtype)  # reduced in reduce_dtype, accumulated in the shard's dtype

    def finish_grads(self) -> None:
        """Reduce-scatter what was accumulated under no_sync and not reduced by a synchronising
        backward (`sync_grads` of the optimizer). COLLECTIVE over the zero group when any unit
        holds such gradients (the same on every rank)."""
        for u in self.units:
            if u.pending is not None:
                send, u.pending = u.pending, None
                grad = self._reduce_scatter(u, send)
                if u.shard.grad is None:
                    u.shard.grad = grad
                else:
                    u.shard.grad.add_(grad)

    def used_flags(self) -> Dict[int, List[bool]]:
        """id(unit) -> per tensor, whether a rank gave it a gradient this step (one device-to-host
        copy for all units: called once per step, by the optimizer's `sync_grads`)."""
        units = [u for u in self.units if u.used is not None]
        flat = torch.cat([u.used for u in units]).tolist() if units else []
        out, at = {}, 0
        for u in units:
            out[id(u)] = flat[at:at + len(u.params)]
            at += len(u.params)
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        for u in self.units:
            if u.shard is not None and u.shard.grad is not None:
                if set_to_none:
                    u.shard.grad = None
                else:
                    u.shard.grad.zero_()
            if u.used is not None:
                u.used.zero_()
            u.pending = None

    # -- whole values ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def unsharded(self, writeback: bool = False) -> Iterator[None]:
        """The registered parameters hold their whole local values inside (COLLECTIVE: every rank
        of the zero group enters it); with `writeback` what was written into them is stored back
        into the shards on exit."""
        if not self.sharded or self._unsharded:
            yield
            return
        self.free_all()
        self._unsharded += 1  # not in the stats' maxima; `get` is not asked meanwhile
        fulls: List[torch.Tensor] = []
        try:
            for u in self.units:
                fulls.append(self._gather(u, whole=True))
                for p, view in zip(u.params, u.flat_views(fulls[-1])):
                    p.data = view
            yield
        finally:
            self._unsharded -= 1
            i = self.groups.group_index
            with torch.no_grad():
                for u, full in zip(self.units, fulls):
                    if writeback:
                        u.shard.copy_(full[i * u.shard_numel:(i + 1) * u.shard_numel])
                    for p in u.params:
                        p.data = _empty(p)
                    self._free(u)

    def __repr__(self) -> str:
        return (f"FullyShardedParams({len(self.units)} units, zero group {self.groups.group_ranks}, "
                f"index {self.groups.group_index})")
