"""What a rank holds of a local tensor it does not hold whole: fully sharded parameters
(``use_zero=3``) keep only flat element ranges of each local tensor (the rank's part of its unit's
shard). `GeneratedAttrs.held_tensors` describes them, so that checkpoints read and write the
shards where they are, without gathering the local tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Tuple

import torch

__all__ = ["HeldRange", "HeldTensor", "flat_blocks"]


@dataclass(frozen=True)
class HeldRange:
    """Elements ``[start, stop)`` of the flattened (row-major) local tensor; `values`: those
    elements as a 1-D tensor that is a view of the held storage (writing into it writes the shard)."""

    start: int
    stop: int
    values: torch.Tensor


@dataclass(frozen=True)
class HeldTensor:
    """One local tensor held in parts: its local `shape` and `dtype` and the `ranges` this rank
    holds (disjoint, ascending; possibly none)."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    ranges: Tuple[HeldRange, ...]


def flat_blocks(shape: Tuple[int, ...], start: int, stop: int) -> Iterator[Tuple[int, Tuple[Tuple[int, int], ...]]]:
    """Flat range ``[start, stop)`` of a row-major tensor of `shape` as rectangular regions, each
    contiguous in memory: (its first flat element, its region as ``((lo, hi), ...)`` per dim), in
    order. At most ``2 * len(shape) - 1`` regions: a partial row at either end, whole rows between."""
    shape = tuple(int(d) for d in shape)
    if not shape:
        if start < stop:
            yield start, ()
        return
    strides: List[int] = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    pos = start
    while pos < stop:
        # the largest block at `pos`: the innermost dims `pos` is aligned to, as many as fit
        d = len(shape) - 1
        while d > 0 and pos % strides[d - 1] == 0 and pos + strides[d - 1] <= stop:
            d -= 1
        step = strides[d]
        index = [(pos // strides[k]) % shape[k] for k in range(len(shape))]
        count = min((stop - pos) // step, shape[d] - index[d])
        region = tuple((index[k], index[k] + 1) for k in range(d)) + ((index[d], index[d] + count),) + \
            tuple((0, shape[k]) for k in range(d + 1, len(shape)))
        yield pos, region
        pos += count * step
