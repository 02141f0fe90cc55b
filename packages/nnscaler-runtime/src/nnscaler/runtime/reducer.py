"""Data-parallel gradient synchronisation that happens inside `loss.backward()`.

`Reducer(params, group)` packs the trainable parameters, in reverse registration order (roughly
the order backward produces their gradients), into buckets of at most `bucket_cap_mb` MB (a
parameter larger than that gets a bucket of its own; a bucket never mixes dtypes or devices) and
hooks every parameter with `register_post_accumulate_grad_hook`. The first hook of a backward pass
queues a callback on the autograd engine that runs when that backward pass ends, so the plain loop

    opt.zero_grad(); loss = model(x); loss.backward(); opt.step()

needs no extra call. At that point every bucket is all-reduced (grads flattened into the bucket
buffer, divided by the group size, summed, copied back): the gradients become the mean over the
group. With `async_op=True` a bucket is launched (`async_op=True` collective) as soon as all its
parameters have their gradient, in bucket order so every rank issues the same sequence, and the
end of backward waits for all of them; nothing is left pending after backward.

Parameters without a gradient on some ranks count as zeros there: after the sync every rank holds
the group mean. A parameter that no rank gave a gradient keeps `.grad = None` on every rank, as in
single-device training (optimizers such as Adam skip it instead of stepping on a zero gradient);
one flag per parameter travels in the bucket buffer for that, no extra collective. (A single-rank
group does no communication and leaves `.grad` untouched.)

`Reducer.no_sync()` (or `Reducer.sync_grad_when(False)`) pauses one reducer, as DDP's
`model.no_sync()`; the process-wide `sync_grad_when(cond)` is a thin wrapper entering `no_sync()`
of every reducer (and pipelined module) alive when the block starts. A
backward pass that starts inside a `False` block only accumulates locally; the next synchronising
pass all-reduces the accumulated gradients. Whether a pass synchronises is decided when its first
gradient arrives, so put the `backward()` call inside the block (`grad_ready.BackwardPass`: the one
rule the fully sharded parameters of use_zero=3 follow too). Several backward passes per step
are fine: each synchronising pass averages `.grad`, and because the mean is linear and already
averaged parts are equal on all ranks, the result is the mean of the sums.

An unused parameter delays the launch of its bucket (and, to keep the order, of the buckets
after it) to the end of backward; results stay correct.

Every all-reduce is waited for through `failures.wait`: a rank whose step failed (or died) makes
this one raise `PeerFailedError` within a fraction of a second instead of blocking (failures/).

Not supported: reentrant activation checkpointing (`use_reentrant=True`) runs a nested backward
whose end would trigger the sync too early; use `use_reentrant=False`.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional

import torch
import torch.distributed as dist

from .device import is_distributed
from .comm.stats import record
from .grad_ready import BackwardPass
from . import failures

_WHAT = "the data-parallel gradient all-reduce"

__all__ = ["Reducer", "ReducerStats", "Pausable", "sync_grad_when", "DEFAULT_BUCKET_CAP_MB"]

DEFAULT_BUCKET_CAP_MB = 25.0
# Objects with a `no_sync()` context (live Reducers, pipelined modules' PipelineGradSync): only
# a list of who to pause; each keeps its own pause count.
_PAUSABLE: "weakref.WeakSet" = weakref.WeakSet()


def pausable(obj):
    """Register `obj` (it has a ``no_sync()`` context manager) with `sync_grad_when`."""
    _PAUSABLE.add(obj)
    return obj


@contextlib.contextmanager
def sync_grad_when(cond: bool) -> Iterator[None]:
    """Inside `sync_grad_when(False)`, backward passes only accumulate gradients locally, for
    every reducer and pipelined module alive when the block starts (the function takes no module,
    so it pauses them all): it enters each one's ``no_sync()``. `True` changes nothing. Nested
    `False` blocks stay local. To pause one module only, use ``module.no_sync()``."""
    if cond:
        yield
        return
    with contextlib.ExitStack() as stack:
        for target in list(_PAUSABLE):
            stack.enter_context(target.no_sync())
        yield


@dataclass
class ReducerStats:
    """Counters for tests and benchmarks."""

    allreduce_calls: int = 0
    allreduce_bytes: int = 0
    synced_passes: int = 0  # backward passes (or sync_grads() calls) that all-reduced
    local_passes: int = 0  # backward passes that only accumulated locally

    def reset(self) -> None:
        self.allreduce_calls = self.allreduce_bytes = self.synced_passes = self.local_passes = 0


class _Bucket:
    """Parameters whose gradients travel in one flat buffer: the gradients, then one "has a
    gradient" flag per parameter (so a parameter no rank used keeps `.grad = None`)."""

    def __init__(self, params: List[torch.nn.Parameter]):
        self.params = params
        self.offsets = []
        numel = 0
        for p in params:
            self.offsets.append(numel)
            numel += p.numel()
        self.numel = numel
        self.buffer: Optional[torch.Tensor] = None
        self.ready = 0
        self.work = None

    @property
    def nbytes(self) -> int:
        return (self.numel + len(self.params)) * self.params[0].element_size()

    def flatten(self) -> torch.Tensor:
        p0 = self.params[0]
        if self.buffer is None or self.buffer.device != p0.device or self.buffer.dtype != p0.dtype:
            self.buffer = torch.empty(self.numel + len(self.params), dtype=p0.dtype, device=p0.device)
        flags = self.buffer[self.numel:]
        flags.fill_(1)
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            view = self.buffer[off:off + p.numel()]
            if p.grad is None:
                view.zero_()
                flags[i] = 0  # rare: no per-element write in the common case
            else:
                view.copy_(p.grad.reshape(-1))
        return self.buffer

    def unflatten(self) -> None:
        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        used = set()
        if missing:  # read flags back (a device sync on CUDA) only when a local gradient is missing
            flags = self.buffer[self.numel:][missing].tolist()
            used = {i for i, flag in zip(missing, flags) if flag > 0}
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            view = self.buffer[off:off + p.numel()].view_as(p)
            if p.grad is not None:
                p.grad.copy_(view)
            elif i in used:  # another rank produced a gradient: take the mean, like every rank
                p.grad = view.clone()


class Pausable:
    """``no_sync()`` / ``sync_grad_when(cond)`` / ``sync_enabled`` over one pause counter (DDP's
    ``no_sync``): inside a ``False`` block, backward passes only accumulate locally; the next
    synchronising one reduces the sum. Shared by the Reducer and the fully sharded parameters."""

    _paused = 0

    def no_sync(self):
        """Backward passes inside only accumulate locally."""
        return self.sync_grad_when(False)

    @contextlib.contextmanager
    def sync_grad_when(self, cond: bool) -> Iterator[None]:
        """Like the module-level `sync_grad_when`, for this object only."""
        if cond:
            yield
            return
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def sync_enabled(self) -> bool:
        """Whether a backward pass starting now would synchronise."""
        return self._paused == 0


class Reducer(Pausable):
    """Averages the gradients of `params` over `group` at the end of every backward pass.

    `params`: the trainable parameters in registration order (frozen ones are skipped,
    duplicates kept once). `group`: a process group (None: the default group; a process without
    torch.distributed or a single-rank group does no communication). `divisor`: what the sum
    is divided by (default the group size: the mean); pipeline devices that hold one tensor sum
    their partial gradients and divide by the data-parallel degree only.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], group=None,
                 bucket_cap_mb: Optional[float] = DEFAULT_BUCKET_CAP_MB, async_op: bool = False,
                 divisor: Optional[int] = None):
        unique, seen = [], set()
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                unique.append(p)
        self.group = group
        self.group_size = dist.get_world_size(group) if is_distributed() else 1
        # the mean is over data-parallel replicas; a group that also joins pipeline devices holding
        # one tensor (partial sums of its gradient) divides by the replica count only
        self.divisor = self.group_size if divisor is None else int(divisor)
        self.bucket_cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else float(bucket_cap_mb)
        self.async_op = bool(async_op)
        self.stats = ReducerStats()
        self._buckets = self._make_buckets(list(reversed(unique)), int(self.bucket_cap_mb * 1024 * 1024))
        self._pass = BackwardPass(lambda: self.sync_enabled, self._finish_pass, self._start_pass)  # grad_ready.py
        self._next_launch = 0
        self._handles = []
        pausable(self)
        if self.group_size > 1:
            for bucket in self._buckets:
                for p in bucket.params:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._hook(bucket)))

    @staticmethod
    def _make_buckets(params: List[torch.nn.Parameter], cap_bytes: int) -> List[_Bucket]:
        buckets, current, size = [], [], 0
        # As DDP: a bucket closes once it reaches the cap (so it may exceed it by its last
        # parameter), which avoids the tiny trailing buckets of closing before the cap.
        for p in params:
            if current and (p.dtype, p.device) != (current[0].dtype, current[0].device):
                buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap_bytes:
                buckets.append(_Bucket(current))
                current, size = [], 0
        if current:
            buckets.append(_Bucket(current))
        return buckets

    # -- public ---------------------------------------------------------------------------------
    @property
    def buckets(self) -> List[List[torch.nn.Parameter]]:
        """The parameters of each bucket, in the order buckets are all-reduced."""
        return [list(b.params) for b in self._buckets]

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def sync_grads(self) -> None:
        """All-reduce the current gradients now (outside backward), e.g. after accumulating
        inside `sync_grad_when(False)` without a final synchronising backward. Collective."""
        if self._pass.active:  # a backward pass that raised before its end
            self._pass.close(reduce=False)
        if self.group_size > 1:
            self._reduce_remaining()

    def remove(self) -> None:
        """Detach the hooks; the reducer does nothing afterwards."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        _PAUSABLE.discard(self)

    # -- backward pass --------------------------------------------------------------------------
    def _hook(self, bucket: _Bucket):
        def on_grad(param: torch.nn.Parameter) -> None:
            if self._pass.enter() and self.async_op:
                bucket.ready += 1
                self._launch_ready()
        return on_grad

    def _start_pass(self) -> None:
        self._next_launch = 0
        for bucket in self._buckets:
            bucket.ready = 0

    def _launch_ready(self) -> None:
        # Launch in bucket order only, so every rank issues the same sequence of collectives.
        while (self._next_launch < len(self._buckets)
               and self._buckets[self._next_launch].ready == len(self._buckets[self._next_launch].params)):
            self._launch(self._buckets[self._next_launch], async_op=True)
            self._next_launch += 1

    def _launch(self, bucket: _Bucket, async_op: bool) -> None:
        buffer = bucket.flatten()
        if self.divisor != 1:
            buffer.div_(self.divisor)  # gloo has no AVG: pre-divide, then sum
        # always launched async: a blocking wait goes through failures.wait (a peer's failure notice)
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        self.stats.allreduce_calls += 1
        self.stats.allreduce_bytes += bucket.nbytes
        record("dp_all_reduce", bucket.nbytes)  # counted apart from tensor-parallel traffic
        if async_op:
            bucket.work = work
        else:
            failures.wait(work, _WHAT, self.group, buffer)

    def _reduce_remaining(self) -> None:
        for bucket in self._buckets[self._next_launch:]:
            self._launch(bucket, async_op=self.async_op)
        self._next_launch = len(self._buckets)
        for bucket in self._buckets:
            if bucket.work is not None:
                failures.wait(bucket.work, _WHAT, self.group, bucket.buffer)
                bucket.work = None
            bucket.unflatten()
        self.stats.synced_passes += 1

    def _finish_pass(self, sync: bool, reduce: bool) -> None:
        try:
            if sync and reduce:
                self._reduce_remaining()
            elif not sync:
                self.stats.local_passes += 1
        finally:
            broken = failures.failed() is not None  # a failed step: its collectives never complete
            for bucket in self._buckets:  # never leave work pending
                if bucket.work is not None and not broken:
                    failures.wait(bucket.work, _WHAT, self.group, bucket.buffer)
                bucket.work = None
            self._next_launch = 0

    def __repr__(self) -> str:
        return (f"Reducer({sum(len(b.params) for b in self._buckets)} params, {len(self._buckets)} buckets, "
                f"group_size={self.group_size}, bucket_cap_mb={self.bucket_cap_mb}, async_op={self.async_op})")
