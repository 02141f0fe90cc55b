"""nnscaler.runtime.ring_tiles (no processes): a masked block's tiles cover every (row, key) pair a row
sees, once, and each holds a seen pair (padding and packed documents, two samples, tile sizes 1 to
the block); a block's plan kept while its intervals are equal; one query part's attention over a key block computed tile by tile (log-sum-exp merged
into the tiles' rows, dq / dk / dv of the tiles' rows and keys) equals torch's on the whole block
(float64, 1e-12; fused CPU kernel and the matrix path)."""
from __future__ import annotations

import pytest
import torch

from nnscaler.runtime import ring_masks, ring_tiles
from nnscaler.runtime.ring_masks import DIAG, FULL, MASKED

S = 24


def _mask():
    """Two samples' (row, key) masks: packed documents of 5, 11, 8 tokens; a causal one with 3 padding keys."""
    doc = torch.tensor([[0] * 5 + [1] * 11 + [2] * 8, [0] * S])
    mask = (doc[:, None, :, None] == doc[:, None, None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    mask[1, ..., 20:] = False
    return mask


@pytest.mark.parametrize("tile", [1, 2, 3, 12])
def test_tiles_cover_the_seen_pairs_once(tile, monkeypatch):
    monkeypatch.setattr(ring_tiles, "TILE", tile)
    mask = _mask()
    iv = ring_masks.intervals(mask, S, ("tiles", tile))
    chunk = 12
    for r0 in (0, chunk):
        for k0 in (0, chunk):
            part = iv[..., r0:r0 + chunk, :]
            if ring_masks.classify(part, r0, k0, chunk) != MASKED:
                continue
            seen = mask[..., r0:r0 + chunk, k0:k0 + chunk].any(0)[0]
            count = torch.zeros(chunk, chunk, dtype=torch.long)
            for t in ring_tiles.tiles(part, r0, k0, chunk):
                count[t.rows, t.keys] += 1
                inside = seen[t.rows, t.keys]
                assert inside.any(), (r0, k0, t)
                if t.kind == FULL:
                    assert inside.all(), (r0, k0, t)
                if t.kind == DIAG:
                    assert r0 + t.rows.start == k0 + t.keys.start and torch.equal(inside, inside.tril()), t
            assert (count <= 1).all() and (count[seen] == 1).all(), (tile, r0, k0)


def test_plan_kept_while_the_intervals_are_the_same(monkeypatch):
    monkeypatch.setattr(ring_tiles, "TILE", 2)
    iv = ring_masks.intervals(_mask(), S, "kept")[:1, :, 12:]  # sample 0, rows 12..23
    first = ring_tiles.tiles(iv, 12, 0, 12)  # keys 0..11: rows 12..15 see 5..11
    assert first and ring_tiles.tiles(iv.clone(), 12, 0, 12) is first  # the next layer's (equal) intervals
    other = iv.clone()
    other[0, 0, :4, 0] = 12  # document 1 starts at row 12 instead of 5: no row sees keys 0..11
    assert ring_tiles.tiles(other, 12, 0, 12) == []


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "matrix"])
def test_block_tile_by_tile_equals_torch(fused, monkeypatch):
    from nnscaler.runtime import ring_attention as ra
    monkeypatch.setattr(ring_tiles, "TILE", 2)
    monkeypatch.setattr(ra, "FUSED_CPU_KERNEL", fused)
    g = torch.Generator().manual_seed(5)
    b, h, d, L = 2, 2, 8, 12  # queries: rows 12..23; keys: the block 0..11 and the diagonal block 12..23
    q = torch.randn(b, h, L, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, h, 2 * L, d, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(b, h, L, d, generator=g, dtype=torch.float64)
    mask = _mask()[..., L:, :]
    iv = ring_masks.intervals(mask, S, ("blocks", fused))
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    bias = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    want = torch.ops.aten._scaled_dot_product_attention_math(*ref, attn_mask=bias, scale=0.3)[0]
    want.backward(dout)
    blocks = ring_masks.plan_blocks([1], [0, 1], L, [iv])
    assert [kind for *_, kind in blocks] == [MASKED, MASKED]
    tiles = {j: ra._tiles(kind, [iv], 0, 1, j, L, L) for _, j, kind in blocks}
    assert sum(len(t) for t in tiles.values()) > 2  # tiled, not whole
    acc = None
    for j, ts in tiles.items():
        for t in ts:
            m = ra._block_mask(None, [iv], 0, t, j * L, L, 0, q.dtype)
            cols = slice(j * L + t.keys.start, j * L + t.keys.stop)
            o, lse = ra._block_forward(q[..., t.rows, :], k[..., cols, :], v[..., cols, :], m, t.kind == DIAG, 0.3)
            acc = ra._merge_rows(acc, o, lse, t.rows, L)
    out, lse = ra._final(acc, q, d)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for j, ts in tiles.items():
        for t in ts:
            m = ra._block_mask(None, [iv], 0, t, j * L, L, 0, q.dtype)
            r, cols = t.rows, slice(j * L + t.keys.start, j * L + t.keys.stop)
            gq, gk, gv = ra._block_backward(dout[..., r, :], q[..., r, :], k[..., cols, :], v[..., cols, :],
                                            out[..., r, :], lse[..., r], m, t.kind == DIAG, 0.3)
            dq[..., r, :] += gq
            dk[..., cols, :] += gk
            dv[..., cols, :] += gv
    for got, exp in ((out, want), (dq, ref[0].grad), (dk, ref[1].grad), (dv, ref[2].grad)):
        assert (got - exp).abs().max().item() <= 1e-12
