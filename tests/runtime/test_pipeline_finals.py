"""The step's outputs broadcast over the unit (runtime/pipeline/finals.py): every rank gets
every micro-batch's values, whatever their dtype and shape, in two broadcasts per source rank
(real gloo processes)."""
from __future__ import annotations

import pytest
import torch

from launch import run_workers


def _values(src: int, m: int):
    g = torch.Generator().manual_seed(100 * src + m)
    return {0: torch.randn((), generator=g),  # a loss
            1: torch.randint(0, 9, (2, 3), generator=g),
            2: torch.randn(4, generator=g).to(torch.bfloat16) if src else torch.rand(3, generator=g) > 0.5,
            3: 7 * m + src}  # an int output


def _finals(rank, world):
    import torch.distributed as dist
    from nnscaler.runtime.pipeline.finals import broadcast_finals
    calls = []
    real = dist.broadcast

    def counting(tensor, src, group=None, **kw):
        calls.append(src)
        return real(tensor, src=src, group=group, **kw)

    dist.broadcast = counting
    try:
        # value 0 and 3 come from the last rank, 1 and 2 from rank 0; 3 micro-batches
        items = [(m, vid, (world - 1) if vid in (0, 3) else 0, vid == 3) for m in range(3) for vid in range(4)]
        got = broadcast_finals(items, lambda m, vid: _values(rank, m)[vid], rank, None, torch.device("cpu"))
    finally:
        dist.broadcast = real
    return {"calls": calls, "got": {f"{m},{v}": (x.tolist(), str(x.dtype)) if torch.is_tensor(x) else x
                                    for (m, v), x in got.items()}}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_every_value_in_two_broadcasts_per_source(world):
    results = run_workers(_finals, world)
    for r in results:
        assert sorted(r["calls"]) == [0, 0, world - 1, world - 1]  # headers + payload, per source
        for m in range(3):
            for vid in range(4):
                src = (world - 1) if vid in (0, 3) else 0
                want = _values(src, m)[vid]
                got = r["got"][f"{m},{vid}"]
                if torch.is_tensor(want):
                    assert got == (want.tolist(), str(want.dtype))
                else:
                    assert got == want
