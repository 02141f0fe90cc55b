"""Ring attention's MASKED blocks (a document or padding boundary crosses them, `ring_masks`) computed
only where some query row sees a key.

`tiles` shrinks such a block to the bounding rectangle of its seen (row, key) pairs (the rows that
see any of its keys, the keys from the smallest lo to the largest hi), classifies it again from the
rows' key intervals, and while it is still MASKED and larger than `TILE` on both sides splits it
into quadrants, each treated the same way: a quadrant no row sees is skipped, one every row sees
whole (or as the causal diagonal) runs without a mask, a MASKED one of at most `TILE` runs with its
rectangle's mask. Forward and backward plan the same tiles from the same intervals (the plan is
kept per block: every layer of a forward has the same intervals), so each tile's dq touches its rows
and its dk / dv its keys only, and the log-sum-exp merge updates the tile's rows only. Packed
documents shorter than a block then cost about their own (query, key) pairs instead of whole blocks;
the ring's transfers stay one per block (tiles are computed, never sent).
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple

import torch

from .ring_masks import DIAG, MASKED, classify

__all__ = ["Tile", "tiles", "TILE"]

TILE = 32
"""A MASKED tile is split into quadrants while both its sides exceed this (tokens): smaller tiles
compute fewer unseen pairs but run more, smaller kernel calls."""


_PLANS = 64  # tile plans kept: a rank's masked blocks of a forward (at most 4 x the cp size)
_plans: Dict[tuple, tuple] = {}  # (row0, k0, width, shape) -> (intervals, TILE, tiles)


class Tile(NamedTuple):
    """Part of a block to compute: its rows and keys (offsets in the block) and how (FULL: no mask,
    DIAG: causal, MASKED: with the tile's mask from the intervals)."""
    rows: slice
    keys: slice
    kind: str

    def pairs(self) -> int:
        """(query row, key) pairs computed (a causal diagonal: those on and below it)."""
        h, w = self.rows.stop - self.rows.start, self.keys.stop - self.keys.start
        return h * (h + 1) // 2 if self.kind == DIAG else h * w


def tiles(iv: torch.Tensor, row0: int, k0: int, width: int) -> List[Tile]:
    """The tiles of the MASKED block of keys ``[k0, k0 + width)`` for the rows with intervals `iv`
    (B, 1, rows, 2) at global positions from `row0`, covering every (row, key) pair a row sees."""
    key = (row0, k0, width, tuple(iv.shape))
    hit = _plans.get(key)
    if hit is not None and hit[1] == TILE and torch.equal(hit[0], iv.to(hit[0].device)):
        return hit[2]  # every layer of a forward (and its backward) has the same intervals
    iv = iv.to("cpu", copy=True)  # many small reductions: on the host, not one device sync each; kept
    out: List[Tile] = []
    _split(iv, row0, k0, 0, iv.shape[-2], 0, width, out)
    if len(_plans) >= _PLANS:
        _plans.clear()
    _plans[key] = (iv, TILE, out)
    return out


def _split(iv, row0, k0, r0, r1, c0, c1, out):
    part = iv[..., r0:r1, :]
    kind = classify(part, row0 + r0, k0 + c0, c1 - c0)
    if kind is None:
        return
    if kind == MASKED:  # first to the rectangle its rows see (a document's rows past the block: whole)
        tile = _clipped(part, row0, k0, r0, c0, c1)
        (r0, r1), (c0, c1), kind = (tile.rows.start, tile.rows.stop), (tile.keys.start, tile.keys.stop), tile.kind
    if kind != MASKED or r1 - r0 <= TILE or c1 - c0 <= TILE:
        out.append(Tile(slice(r0, r1), slice(c0, c1), kind))
        return
    rm, cm = (r0 + r1) // 2, (c0 + c1) // 2
    for rows in ((r0, rm), (rm, r1)):
        for keys in ((c0, cm), (cm, c1)):
            _split(iv, row0, k0, *rows, *keys, out)


def _clipped(part, row0, k0, r0, c0, c1) -> Tile:
    """The bounding rectangle of the (row, key) pairs seen in keys [c0, c1) by the rows of `part`
    (from offset r0), classified again (it may be seen whole)."""
    lo, hi = part[..., 0] - k0, part[..., 1] - k0  # offsets in the block
    sees = (hi >= c0) & (lo < c1) & (lo <= hi)
    rows = sees.flatten(0, -2).any(0).nonzero().flatten()
    first, last = int(rows[0]), int(rows[-1]) + 1
    kfirst = max(c0, int(torch.where(sees, lo, c1).min()))
    klast = min(c1, int(torch.where(sees, hi, c0 - 1).max()) + 1)
    kind = classify(part[..., first:last, :], row0 + r0 + first, k0 + kfirst, klast - kfirst)
    return Tile(slice(r0 + first, r0 + last), slice(kfirst, klast), kind)
