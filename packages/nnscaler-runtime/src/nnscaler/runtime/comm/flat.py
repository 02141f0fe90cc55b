"""All-gather and reduce-scatter of flat buffers over a process group, each with its fallback
where the backend lacks the native collective (`nnscaler.runtime.comm.fallbacks`).

The one implementation under both the layout collectives of `primitives` (which permute pieces
into group order around it) and ZeRO's buckets. Each call is recorded in the comm stats under
`label` (``label + "(fallback)"`` on the fallback path; no record when `label` is None) and runs
under `failures.run` (a failed peer raises here instead of hanging).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import failures
from . import fallbacks
from .stats import record

__all__ = ["all_gather_flat", "start_all_gather_flat", "reduce_scatter_rows"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _record(label: Optional[str], fallback: bool, nbytes: int) -> None:
    if label is not None:
        record(f"{label}(fallback)" if fallback else label, nbytes)


def all_gather_flat(x: torch.Tensor, group, n: int, *, label: Optional[str], what: str) -> torch.Tensor:
    """Every rank's `x` (same shape everywhere) concatenated in group-rank order: a flat tensor
    of ``n * x.numel()`` elements. COLLECTIVE over `group` (of `n` ranks)."""
    x = x.contiguous()
    fallback = fallbacks.uses_fallback("all_gather", str(dist.get_backend(group)), x.device.type)
    _record(label, fallback, x.nbytes)
    if fallback:
        out = [torch.empty_like(x) for _ in range(n)]
        failures.run(dist.all_gather, out, x, group=group, what=what)
        return torch.cat([o.view(-1) for o in out])
    full = x.new_empty(n * x.numel())
    failures.run(_all_gather_single, full, x.view(-1), group=group, what=what)
    return full


def start_all_gather_flat(x: torch.Tensor, group, n: int, *, label: Optional[str]):
    """`all_gather_flat` launched without waiting: ``(work, out)``, where `out` holds the result once
    ``work`` completed (wait with `failures.wait`); None where the backend needs the fallback (then
    call `all_gather_flat`). COLLECTIVE over `group`."""
    x = x.contiguous()
    if fallbacks.uses_fallback("all_gather", str(dist.get_backend(group)), x.device.type):
        return None
    _record(label, False, x.nbytes)
    full = x.new_empty(n * x.numel())
    return _all_gather_single(full, x.view(-1), group=group, async_op=True), full


def reduce_scatter_rows(send: torch.Tensor, group, index: int, *, label: Optional[str], what: str,
                        may_overwrite: bool = False) -> torch.Tensor:
    """Row `index` (this rank's position in `group`) of the sum over the group's ranks of `send`,
    a contiguous ``(n, ...)`` tensor. The fallback all-reduces `send` itself when
    `may_overwrite`, else a copy. COLLECTIVE over `group`."""
    fallback = fallbacks.uses_fallback("reduce_scatter", str(dist.get_backend(group)), send.device.type)
    _record(label, fallback, send.nbytes)
    if fallback:
        total = send if may_overwrite else send.clone(memory_format=torch.contiguous_format)
        failures.run(dist.all_reduce, total, group=group, what=what)
        return total[index].clone(memory_format=torch.contiguous_format)
    out = send.new_empty(send.shape[1:])
    failures.run(_reduce_scatter_single, out.view(-1), send.contiguous().view(-1), group=group, what=what)
    return out
