"""nnscaler.runtime.ring_attention on real gloo processes: on n ranks, each holding 1/n of the
sequence, the output and the gradients of q, k, v equal ``F.scaled_dot_product_attention`` on the
whole sequence in one process (float64, 1e-12): causal (rows balanced in the zigzag layout), with
a padding + causal mask (bool and additive), without either, with grouped-query heads and a
given scale, at n = 2 and 4, with unsorted ranks. One launch of 4 ranks runs every case."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from launch import run_workers

B, HQ, HKV, S, D = 2, 4, 2, 16, 8


def _problem(seed, mask_kind):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, S, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, HQ, S, D, generator=g, dtype=torch.float64)
    mask = None
    if mask_kind:
        keep = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S).clone()
        keep[1, :, :, :3] = False  # sample 1: 3 left-padding keys
        keep[1, :, :3, 0] = True  # ... that its padding rows still see (no row without keys)
        mask = keep if mask_kind == "bool" else torch.zeros(B, 1, S, S, dtype=torch.float64).masked_fill(~keep, -1e9)
    return q, k, v, dout, mask


def _job(rank, world, cases):
    import torch.distributed as dist
    from nnscaler.runtime import ring_attention
    from nnscaler.runtime.comm import count_collectives, group_for
    out = {}
    for label, ranks, seed, causal, mask_kind in cases:
        group_for(sorted(ranks))
        if rank not in ranks:
            continue
        n, piece = len(ranks), ranks.index(rank)
        q, k, v, dout, mask = _problem(seed, mask_kind)
        rows = slice(piece * S // n, (piece + 1) * S // n)
        kw = dict(is_causal=causal, scale=0.3, enable_gqa=True)
        leaves = [t[:, :, rows].clone().requires_grad_(True) for t in (q, k, v)]
        with count_collectives() as stats:
            got = ring_attention.attention(*leaves, None if mask is None else mask[:, :, rows], ranks=ranks, **kw)
            got.backward(dout[:, :, rows])
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*full, attn_mask=mask, **kw)
        want.backward(dout)
        diffs = [(got - want[:, :, rows]).abs().max().item()] + [
            (a.grad - b.grad[:, :, rows]).abs().max().item() for a, b in zip(leaves, full)]
        out[label] = (diffs, stats.calls("all_to_all"))
    dist.barrier()
    return out


CASES = [("causal-4", (0, 1, 2, 3), 1, True, None), ("causal-2-unsorted", (3, 1), 2, True, None),
         ("mask-bool-4", (0, 1, 2, 3), 3, False, "bool"), ("mask-float-2", (0, 2), 4, False, "float"),
         ("full-2", (1, 2), 5, False, None)]


@pytest.mark.multiprocess
def test_ring_attention_equals_one_process():
    results = run_workers(_job, 4, CASES, timeout=120)
    for label, ranks, _, causal, _ in CASES:
        for rank in ranks:
            diffs, all_to_all = results[rank][label]
            assert max(diffs) <= 1e-12, (label, rank, diffs)
            assert all_to_all == (8 if causal else 0), (label, all_to_all)  # q, k, v in and the output out; backward the same
