"""All-to-all with variable counts, as an autograd function: rows of a tensor to other ranks.

`exchange_rows(x, send, recv, rs)`: `x`'s rows are laid out in piece order, ``send[j]`` rows for
piece j of the resolved rank set `rs` (`primitives.resolve`); the result holds the rows received,
``recv[j]`` from piece j, in piece order. The backward sends the gradients back the same way.
Used by expert parallelism (`nnscaler.runtime.moe`: tokens to their experts' ranks) and by
context parallelism (`nnscaler.runtime.ring_attention`: sequence chunks to their load-balanced
owners). Natively ``all_to_all_single`` with split sizes (gloo on CPU, NCCL); a backend without it
takes the fallback of `fallbacks` (every rank's rows gathered, padded to the longest). Counted as
``all_to_all`` (payload: the rows handed in).
"""
from __future__ import annotations

import math
from typing import List

import torch
import torch.distributed as dist
from torch.autograd import Function

from .. import failures
from . import fallbacks
from .flat import all_gather_flat
from .stats import record

__all__ = ["exchange_rows"]


def exchange_rows(x: torch.Tensor, send: List[int], recv: List[int], rs) -> torch.Tensor:
    """The rows each piece sent here (see the module docstring). COLLECTIVE over `rs`."""
    return _ExchangeRows.apply(x, list(send), list(recv), rs)


class _ExchangeRows(Function):
    """Rows to other ranks: `send[j]` rows (in order) to piece j, `recv[j]` rows from piece j. The
    backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, send, recv, rs):
        ctx.send, ctx.recv, ctx.rs = send, recv, rs
        return _exchange(x, send, recv, rs)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.rs), None, None, None


def _exchange(x: torch.Tensor, send: List[int], recv: List[int], rs) -> torch.Tensor:
    """`x`'s rows in piece order (`send[j]` for piece j) -> the rows received, in piece order."""
    if rs.to_group is None:
        return _exchange_in_group_order(x, send, recv, rs)
    order = [int(p) for p in rs.to_group]  # group rank g holds piece order[g]
    out = _exchange_in_group_order(_reorder(x, send, order), [send[p] for p in order], [recv[p] for p in order], rs)
    back = [order.index(p) for p in range(rs.n)]
    return _reorder(out, [recv[p] for p in order], back)


def _reorder(x: torch.Tensor, sizes: List[int], order: List[int]) -> torch.Tensor:
    """The chunks of `x` (of `sizes`) concatenated in `order`."""
    chunks = torch.split(x, sizes)
    return torch.cat([chunks[i] for i in order]) if chunks else x


def _exchange_in_group_order(x: torch.Tensor, send_g: List[int], recv_g: List[int], rs) -> torch.Tensor:
    x = x.contiguous()
    row = tuple(x.shape[1:])
    width = math.prod(row)
    what = f"the expert-parallel all_to_all over ranks {rs.ranks}"
    if not fallbacks.uses_fallback("all_to_all", rs.backend, x.device.type):
        record("all_to_all", x.nbytes)
        out = x.new_empty((sum(recv_g),) + row)
        failures.run(dist.all_to_all_single, out, x, recv_g, send_g, group=rs.group, what=what)
        return out
    # fallback: every rank's rows, padded to the longest, gathered; keep what was sent here
    record("all_to_all(fallback)", x.nbytes)
    longest = int(all_gather_flat(torch.tensor([x.shape[0]], device=x.device), rs.group, rs.n,
                                  label=None, what=what).max())
    padded = torch.cat([x.reshape(x.shape[0], width), x.new_zeros(longest - x.shape[0], width)])
    every = all_gather_flat(padded, rs.group, rs.n, label=None, what=what).view(rs.n, longest, width)
    sizes = _all_splits(send_g, rs, x.device)  # sizes[src group rank][dst group rank]
    me = rs.key.index(dist.get_rank())
    parts = []
    for src in range(rs.n):
        start = sum(sizes[src][:me])
        parts.append(every[src, start:start + sizes[src][me]])
    return torch.cat(parts).reshape((sum(recv_g),) + row)


def _all_splits(send_g: List[int], rs, device) -> List[List[int]]:
    flat = all_gather_flat(torch.tensor(send_g, device=device), rs.group, rs.n, label=None,
                           what=f"the expert-parallel all_to_all over ranks {rs.ranks}")
    return flat.view(rs.n, rs.n).tolist()
