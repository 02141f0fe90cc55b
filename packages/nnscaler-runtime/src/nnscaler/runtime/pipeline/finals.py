"""The step's outputs (the loss, what the forward returns) on every rank of the unit: each value
is produced on one stage's ranks and broadcast from there, for every micro-batch.

One broadcast per value and micro-batch (a header, then the payload: 2 x nmicros collectives per
step for a loss) cost a collective's latency each; on gloo that is 0.3-1.5 ms apiece. Here every
value one rank sends, of all the step's micro-batches, goes in two broadcasts: one int64 tensor
with a header row per value (for an int value the int itself), then one byte buffer with the
tensors' bytes back to back.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import failures
from .p2p import HEADER_LEN, empty_from_header, tensor_header

__all__ = ["broadcast_finals"]

_WHAT = "the broadcast of the pipeline step's outputs"


def broadcast_finals(items: Sequence[Tuple[int, int, int, bool]], mine: Callable[[int, int], Any], rank: int,
                     group, device) -> Dict[Tuple[int, int], Any]:
    """(micro, value id) -> value on every rank of `group`. `items`: (micro, value id, source
    rank, is an int) in the same order on every rank; `mine(micro, vid)`: the value where this
    rank is the source."""
    by_src: Dict[int, List[Tuple[int, int, bool]]] = {}
    for m, vid, src, is_int in items:
        by_src.setdefault(src, []).append((m, vid, is_int))
    out: Dict[Tuple[int, int], Any] = {}
    for src in sorted(by_src):
        out.update(_from(src, by_src[src], mine, rank, group, device))
    return out


def _from(src: int, entries: List[Tuple[int, int, bool]], mine, rank: int, group, device) -> Dict[Tuple[int, int], Any]:
    headers = torch.zeros(len(entries), HEADER_LEN, dtype=torch.int64, device=device)
    payload = []
    if rank == src:
        for i, (m, vid, is_int) in enumerate(entries):
            value = mine(m, vid)
            if is_int:
                headers[i, 0] = int(value)
            else:
                t = value.detach().contiguous()
                headers[i] = tensor_header(t).to(device)
                payload.append(t.reshape(-1).view(torch.uint8))
    failures.run(dist.broadcast, headers, src=src, group=group, what=_WHAT)  # a dead peer: PeerFailedError
    rows = headers.tolist()
    empties = {} if rank == src else {i: empty_from_header(torch.tensor(rows[i]), device).requires_grad_(False)
                                      for i, (_, _, is_int) in enumerate(entries) if not is_int}
    if rank == src:
        buf = torch.cat(payload) if payload else torch.empty(0, dtype=torch.uint8, device=device)
    else:
        nbytes = sum(t.numel() * t.element_size() for t in empties.values())
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if buf.numel():
        failures.run(dist.broadcast, buf, src=src, group=group, what=_WHAT)
    out, offset = {}, 0
    for i, (m, vid, is_int) in enumerate(entries):
        if is_int:
            out[(m, vid)] = mine(m, vid) if rank == src else int(rows[i][0])
            continue
        if rank == src:
            out[(m, vid)] = mine(m, vid).detach().contiguous()
            continue
        t = empties[i]
        size = t.numel() * t.element_size()
        t.reshape(-1).view(torch.uint8).copy_(buf[offset:offset + size])
        offset += size
        out[(m, vid)] = t
    return out
