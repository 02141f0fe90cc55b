"""nnscaler.runtime.ring_attention on real gloo processes: on n ranks, each holding 1/n of the
sequence, the output and the gradients of q, k, v equal ``F.scaled_dot_product_attention`` on the
whole sequence in one process (float64, 1e-12): causal (rows balanced in the zigzag layout), with
a padding + causal mask (bool and additive), packed documents (a causal mask per document), key
padding broadcast over the rows, without any, with a value head size other than the query's; a
boolean mask is read as key intervals (balanced when causal-like, nothing of its size kept for
backward), with grouped-query heads and a given scale, at n = 2 and 4, with unsorted ranks. In
bfloat16 (both block paths: the fused CPU kernel and the matrix one other devices run) against
float32 ``scaled_dot_product_attention``: within torch's own bfloat16 ``scaled_dot_product_attention``
error (the softmax statistics, the merge and the gradient sums are float32). One launch of 4 ranks
runs every case. The fast tier checks the blocks with a value head size other than the query's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from launch import run_workers

B, HQ, HKV, S, D = 2, 4, 2, 16, 8


def _problem(seed, mask_kind, dv=D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, S, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(B, HQ, S, dv, generator=g, dtype=torch.float64)
    mask = None
    if mask_kind:
        keep = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S).clone()
        keep[1, :, :, :3] = False  # sample 1: 3 left-padding keys
        keep[1, :, :3, 0] = True  # ... that its padding rows still see (no row without keys)
        mask = keep if mask_kind == "bool" else torch.zeros(B, 1, S, S, dtype=torch.float64).masked_fill(~keep, -1e9)
    if mask_kind == "packed":  # documents of 5, 6 and 5 tokens (sample 1: 9 and 7), causal inside each
        doc = torch.tensor([[0] * 5 + [1] * 6 + [2] * 5, [0] * 9 + [1] * 7])
        mask = (doc[:, None, :, None] == doc[:, None, None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    if mask_kind == "keys":  # right padding of the keys only (2 and 0 positions), broadcast over the rows
        mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
        mask[0, ..., S - 2:] = False
    return q, k, v, dout, mask


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _bf16_errors(rank, ranks, causal, mask_kind, fused):
    """(ring bf16 vs sdpa fp32, sdpa bf16 vs sdpa fp32): relative errors of the output and the q, k, v
    gradients on this rank's rows."""
    from nnscaler.runtime import ring_attention
    n, piece = len(ranks), ranks.index(rank)
    g = torch.Generator().manual_seed(11)
    s = 128
    q, k = torch.randn(B, HQ, s, 16, generator=g) * 3, torch.randn(B, HKV, s, 16, generator=g) * 3
    v, dout = torch.randn(B, HKV, s, 16, generator=g), torch.randn(B, HQ, s, 16, generator=g)
    mask = None
    if mask_kind:
        mask = torch.ones(s, s, dtype=torch.bool).tril().expand(B, 1, s, s).clone()
        mask[1, :, :, :5] = False
        mask[1, :, :5, 0] = True
    rows = slice(piece * s // n, (piece + 1) * s // n)
    kw = dict(is_causal=causal, enable_gqa=True)
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, attn_mask=mask, **kw).backward(dout)
    low = [t.bfloat16().requires_grad_(True) for t in (q, k, v)]
    sdpa = F.scaled_dot_product_attention(*low, attn_mask=mask, **kw)
    sdpa.backward(dout.bfloat16())
    ring_attention.FUSED_CPU_KERNEL = fused
    try:
        mine = [t[:, :, rows].bfloat16().clone().requires_grad_(True) for t in (q, k, v)]
        got = ring_attention.attention(*mine, None if mask is None else mask[:, :, rows], ranks=ranks, **kw)
        got.backward(dout[:, :, rows].bfloat16())
    finally:
        ring_attention.FUSED_CPU_KERNEL = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)[:, :, rows]
    ring = [_rel(got, want)] + [_rel(a.grad, b.grad[:, :, rows]) for a, b in zip(mine, ref)]
    torch_bf16 = [_rel(sdpa[:, :, rows], want)] + [_rel(a.grad[:, :, rows], b.grad[:, :, rows]) for a, b in zip(low, ref)]
    return ring, torch_bf16


def _job(rank, world, cases, bf16_cases=()):
    import torch.distributed as dist
    from nnscaler.runtime import ring_attention, ring_tiles
    from nnscaler.runtime.comm import count_collectives, group_for
    out = {}
    default_tile = ring_tiles.TILE
    for label, ranks, seed, causal, mask_kind, *dv in cases:
        ring_tiles.TILE = 1 if label.endswith("tile1") else default_tile  # masked blocks tiled to single rows / keys
        group_for(sorted(ranks))
        if rank not in ranks:
            continue
        n, piece = len(ranks), ranks.index(rank)
        q, k, v, dout, mask = _problem(seed, mask_kind, *dv)
        rows = slice(piece * S // n, (piece + 1) * S // n)
        kw = dict(is_causal=causal, scale=0.3, enable_gqa=True)
        leaves = [t[:, :, rows].clone().requires_grad_(True) for t in (q, k, v)]
        local_mask = None if mask is None else mask[:, :, rows] if mask.shape[-2] > 1 else mask
        saved = []
        ring_attention.WORK.update(calls=0, blocks=0, pairs=0)
        with count_collectives() as stats:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape[-2:])) or t, lambda t: t):
                got = ring_attention.attention(*leaves, local_mask, ranks=ranks, **kw)
            got.backward(dout[:, :, rows])
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*full, attn_mask=mask, **kw)
        want.backward(dout)
        diffs = [(got - want[:, :, rows]).abs().max().item()] + [
            (a.grad - b.grad[:, :, rows]).abs().max().item() for a, b in zip(leaves, full)]
        out[label] = (diffs, stats.calls("all_to_all"), (S // n, S) in saved, ring_attention.WORK["pairs"])
    ring_tiles.TILE = default_tile
    for label, ranks, causal, mask_kind, fused in bf16_cases:
        group_for(sorted(ranks))
        if rank in ranks:
            out[label] = _bf16_errors(rank, ranks, causal, mask_kind, fused)
    dist.barrier()
    return out


CASES = [("causal-4", (0, 1, 2, 3), 1, True, None), ("causal-2-unsorted", (3, 1), 2, True, None),
         ("mask-bool-4", (0, 1, 2, 3), 3, False, "bool"), ("mask-float-2", (0, 2), 4, False, "float"),
         ("full-2", (1, 2), 5, False, None), ("packed-4", (0, 1, 2, 3), 6, False, "packed"),
         ("packed-2", (2, 0), 7, False, "packed"), ("keys-2", (1, 3), 8, False, "keys"),
         ("packed-4-tile1", (0, 1, 2, 3), 6, False, "packed"), ("packed-2-tile1", (1, 3), 7, False, "packed"),
         ("mask-bool-4-tile1", (3, 2, 1, 0), 3, False, "bool"),
         # a value head size other than the query / key one (DeepSeek-V3's MLA), larger and smaller
         ("causal-2-dv12", (0, 1), 9, True, None, 12), ("mask-bool-2-dv6", (3, 2), 10, False, "bool", 6)]
# all-to-alls a call: balanced, q, k, v in and the output out, backward the output again (not kept twice),
# dout in and dq, dk, dv out; a mask read as key intervals (causal-like) also its rows' intervals
ALL_TO_ALL = {"causal-4": 9, "causal-2-unsorted": 9, "mask-bool-4": 10, "packed-4": 10, "packed-2": 10,
              "causal-2-dv12": 9, "mask-bool-2-dv6": 10, "packed-4-tile1": 10, "packed-2-tile1": 10,
              "mask-bool-4-tile1": 10}


BF16 = [("bf16-causal-4-fused", (0, 1, 2, 3), True, None, True), ("bf16-causal-4-matrix", (0, 1, 2, 3), True, None, False),
        ("bf16-mask-2-fused", (0, 1), False, "bool", True), ("bf16-mask-2-matrix", (2, 3), False, "bool", False),
        ("bf16-full-2-matrix", (1, 3), False, None, False)]


@pytest.mark.multiprocess
def test_ring_attention_equals_one_process():
    """float64: exact; bfloat16: each of output, dq, dk, dv within 1.25x torch's bfloat16 SDPA error
    against float32 (with statistics in bfloat16 the matrix path was 5-8x: 4.4e-2 against 8.4e-3)."""
    results = run_workers(_job, 4, CASES, BF16, timeout=180)
    for label, ranks, *_ in BF16:
        for rank in ranks:
            ring, torch_bf16 = results[rank][label]
            for what, r, t in zip(("out", "dq", "dk", "dv"), ring, torch_bf16):
                assert r <= 1.25 * t + 1e-4, (label, rank, what, r, t)
    for label, ranks, *_ in CASES:
        for rank in ranks:
            diffs, all_to_all, mask_saved, _ = results[rank][label]
            assert max(diffs) <= 1e-12, (label, rank, diffs)
            assert all_to_all == ALL_TO_ALL.get(label, 0), (label, all_to_all)
            # a mask read as intervals is not kept: nothing of (rows x keys) saved (an additive -1e9 is a bias)
            assert mask_saved == (label == "mask-float-2"), (label, rank)
    # causal: every rank computes the same (query, key) pairs (packed documents: test_ring_masks.py)
    causal = [results[r]["causal-4"][3] for r in range(4)]
    assert len(set(causal)) == 1 and causal[0] > 0, causal
    # masked blocks tiled to single rows / keys compute exactly the (row, key) pairs some sample's row
    # sees (a tile is shared by the batch); whole masked blocks compute more
    for label, ranks, seed, causal, mask_kind in [c for c in CASES if c[0].endswith("tile1")]:
        seen = int(_problem(seed, mask_kind)[4].any(0).sum())
        tiled = sum(results[r][label][3] for r in ranks)
        base = next(c for c in CASES if c[0] == label[:-len("-tile1")])  # the same problem, default tiles
        coarse = sum(results[r][base[0]][3] for r in base[1])
        assert tiled == seen < coarse, (label, tiled, seen, coarse)


def _layout_job(rank, world):
    """(label, layout of the query, output strides, torch's SDPA output strides for the same local
    inputs, transpose(1, 2).contiguous() is a view of the output, max |error| of output and grads)."""
    import torch.distributed as dist
    from nnscaler.runtime import ring_attention
    from nnscaler.runtime.comm import group_for
    ranks = (0, 1)
    group_for(ranks)
    out = []
    for label, causal, mask_kind in (("causal", True, None), ("mask", False, "bool"), ("full", False, None)):
        for layout in ("bshd", "bhsd"):
            q, k, v, dout, mask = _problem(7, mask_kind)
            rows = slice(rank * S // 2, (rank + 1) * S // 2)
            kw = dict(is_causal=causal, scale=0.3, enable_gqa=True)

            def local(t):  # as transformers: the projection's (B, S, H, D) viewed as (B, H, S, D)
                t = t[:, :, rows]
                t = t.transpose(1, 2).contiguous().transpose(1, 2) if layout == "bshd" else t.contiguous()
                return t.requires_grad_(True)

            leaves = [local(t) for t in (q, k, v)]
            lmask = None if mask is None else mask[:, :, rows]
            got = ring_attention.attention(*leaves, lmask, ranks=ranks, **kw)
            # torch's own CPU kernel on the same local tensors (keys of this rank's rows only: the values
            # differ, the layout is what is compared)
            ref = F.scaled_dot_product_attention(*[t.detach() for t in leaves],
                                               attn_mask=None if lmask is None else lmask[..., rows], **kw)
            moved = got.transpose(1, 2).contiguous()
            got.backward(dout[:, :, rows])
            full = [t.clone().requires_grad_(True) for t in (q, k, v)]
            want = F.scaled_dot_product_attention(*full, attn_mask=mask, **kw)
            want.backward(dout)
            err = max([(got - want[:, :, rows]).abs().max().item()] + [
                (a.grad - b.grad[:, :, rows]).abs().max().item() for a, b in zip(leaves, full)])
            out.append((label, layout, got.stride(), ref.stride(), moved.data_ptr() == got.data_ptr(), err))
    dist.barrier()
    return out


@pytest.mark.multiprocess
def test_ring_attention_output_layout_follows_sdpa():
    """The output has the strides torch's CPU ``scaled_dot_product_attention`` gives for the same
    inputs (the query's layout): with transformers' (batch, sequence, heads, dim) projections, the
    model's ``transpose(1, 2).contiguous()`` after attention is then a view, not a copy (as in one
    process); values and gradients stay exact."""
    results = run_workers(_layout_job, 2, timeout=120)
    for rank in (0, 1):
        assert len(results[rank]) == 6
        for label, layout, strides, sdpa_strides, shared, err in results[rank]:
            assert strides == sdpa_strides, (rank, label, layout, strides, sdpa_strides)
            assert shared == (layout == "bshd"), (rank, label, layout)
            assert err <= 1e-12, (rank, label, layout, err)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "matrix"])
@pytest.mark.parametrize("dqk,dv", [(12, 8), (8, 12)], ids=["dv<dqk", "dv>dqk"])
@pytest.mark.parametrize("mask_kind", [None, "bool"])
def test_ring_blocks_value_head_size_differs(fused, dqk, dv, mask_kind):
    """A value head size other than the query / key one (DeepSeek-V3's MLA: v_head_dim against
    qk_nope_head_dim + qk_rope_head_dim), no processes: the ring's two key blocks of one query chunk
    (causal: one full, one diagonal), merged by log-sum-exp, and their backward given the merged
    output and statistics, equal torch's math ``scaled_dot_product_attention`` and its autograd
    (float64, 1e-12), through the fused CPU kernel (zero-padded to one head size) and the matrix path."""
    from nnscaler.runtime import ring_attention as ra
    g = torch.Generator().manual_seed(3)
    L = 6  # rows of a chunk; the queries are chunk 1, the keys chunks 0 and 1
    q = torch.randn(B, HQ, L, dqk, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, 2 * L, dqk, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, 2 * L, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(B, HQ, L, dv, generator=g, dtype=torch.float64)
    keep = torch.ones(L, 2 * L, dtype=torch.bool).tril(L).expand(B, 1, L, 2 * L).clone()
    if mask_kind:
        keep[1, :, :, :4] = False  # sample 1: 4 padding keys, all in block 0
    groups, scale = HQ // HKV, 0.3
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    bias = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))  # the raw op adds it
    want = torch.ops.aten._scaled_dot_product_attention_math(
        ref[0], ra._expand(ref[1], groups), ra._expand(ref[2], groups), attn_mask=bias, scale=scale)[0]
    want.backward(dout)
    blocks = [(slice(0, L), bias[..., :L] if mask_kind else None, False),  # block 0: full (or masked)
              (slice(L, 2 * L), None, True)]  # block 1: the diagonal
    ra.FUSED_CPU_KERNEL = fused
    try:
        acc = None
        for cols, m, diag in blocks:
            acc = ra._merge(acc, *ra._block_forward(q, ra._expand(k[..., cols, :], groups),
                                                    ra._expand(v[..., cols, :], groups), m, diag, scale))
        out, lse = ra._final(acc, q, dv)
        dq, dk, dvs = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for cols, m, diag in blocks:
            gq, gk, gv = ra._block_backward(dout, q, ra._expand(k[..., cols, :], groups),
                                            ra._expand(v[..., cols, :], groups), out, lse, m, diag, scale)
            dq += gq
            dk[..., cols, :] += ra._fold(gk, groups)
            dvs[..., cols, :] += ra._fold(gv, groups)
    finally:
        ra.FUSED_CPU_KERNEL = True
    assert out.shape == (B, HQ, L, dv)
    for got, exp in ((out, want), (dq, ref[0].grad), (dk, ref[1].grad), (dvs, ref[2].grad)):
        assert got.shape == exp.shape and (got - exp).abs().max().item() <= 1e-12
