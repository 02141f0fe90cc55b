"""`flat_blocks`: a flat range of a row-major tensor as contiguous rectangular regions (how a
fully sharded rank's shard ranges are saved as checkpoint pieces)."""
from __future__ import annotations

import math

import pytest
import torch

from nnscaler.ir.contracts import flat_blocks


@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 3, 4), (1, 1, 7), (4, 1, 3), (3, 0, 2)])
def test_flat_blocks_tile_every_range(shape):
    n = math.prod(shape)
    x = torch.arange(n).reshape(shape)
    for start in range(n + 1):
        for stop in range(start, n + 1):
            blocks = list(flat_blocks(shape, start, stop))
            got = []
            for first, region in blocks:
                values = x[tuple(slice(lo, hi) for lo, hi in region)].reshape(-1)
                assert values.numel() and int(values[0]) == first, (shape, start, stop, blocks)
                got += values.tolist()
            assert got == list(range(start, stop)), (shape, start, stop, blocks)
            assert len(blocks) <= max(1, 2 * len(shape) - 1), (shape, start, stop, blocks)


def test_flat_blocks_whole_rows_are_one_block():
    assert list(flat_blocks((4, 3), 3, 9)) == [(3, ((1, 3), (0, 3)))]
    assert list(flat_blocks((4, 3), 2, 10)) == [(2, ((0, 1), (2, 3))), (3, ((1, 3), (0, 3))), (9, ((3, 4), (0, 1)))]
