"""Ring attention's row layouts: contiguous (rank i holds rows ``[i * L, (i + 1) * L)``) and the
balanced zigzag (rank i holds sequence chunks i and 2N-1-i of 2N), the exchange between them (one
all-to-all of equal sub-chunks), and outputs concatenated in the caller's memory layout.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .comm.exchange import exchange_rows

__all__ = ["cat_like", "zigzag", "chunks"]


def cat_like(parts, like: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.cat(parts, dim)`` whose memory follows `like`'s dim order (as ``empty_like``), not the
    default contiguous one: the output of ``F.scaled_dot_product_attention`` on the CPU has its
    query's layout, which is (batch, sequence, heads, dim) in transformers' attention (the
    projections viewed and transposed), so the model's ``transpose(1, 2).contiguous()`` after it
    copies nothing; ring attention's output does the same."""
    order = sorted(range(like.dim()), key=lambda d: -like.stride(d))  # outermost first (stable on ties)
    if order == list(range(like.dim())):
        return torch.cat(parts, dim)
    inverse = [order.index(d) for d in range(like.dim())]
    return torch.cat([p.permute(order) for p in parts], order.index(dim % like.dim())).permute(inverse)


def _owner(chunk: int, n: int) -> int:
    return chunk if chunk < n else 2 * n - 1 - chunk


def zigzag(x: torch.Tensor, rs, forward: bool, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows (dim -2) from the contiguous layout (piece i: sub-chunks 2i, 2i+1 of 2N) to the balanced
    one (piece i: sub-chunks i, 2N-1-i), or back (in the memory layout of `like` when given).
    Sub-chunks are equal, so every count is known."""
    n, me = rs.n, rs.index
    contiguous = lambda c: c // 2  # noqa: E731  (the piece holding sub-chunk c in each layout)
    balanced = lambda c: _owner(c, n)  # noqa: E731
    mine, want = ([2 * me, 2 * me + 1], [me, 2 * n - 1 - me]) if forward else ([me, 2 * n - 1 - me], [2 * me, 2 * me + 1])
    dest, src = (balanced, contiguous) if forward else (contiguous, balanced)
    half = x.shape[-2] // 2
    parts = torch.split(x.movedim(-2, 0), half)
    order = sorted(range(2), key=lambda i: (dest(mine[i]), mine[i]))  # every sender: by destination, then chunk
    send, recv = [0] * n, [0] * n
    for c in mine:
        send[dest(c)] += half
    for c in want:
        recv[src(c)] += half
    got = torch.split(exchange_rows(torch.cat([parts[i] for i in order]), send, recv, rs), half)
    arrival = sorted(want, key=lambda c: (src(c), c))  # rows arrive by source piece, then its order
    if like is not None:
        return cat_like([got[arrival.index(c)].movedim(0, -2) for c in want], like, -2)
    return torch.cat([got[arrival.index(c)] for c in want]).movedim(0, -2)


def chunks(piece: int, n: int, balanced: bool) -> List[int]:
    """Global chunk ids held by `piece`: (i, 2N-1-i) of 2N when balanced, else (i,) of N."""
    return [piece, 2 * n - 1 - piece] if balanced else [piece]
