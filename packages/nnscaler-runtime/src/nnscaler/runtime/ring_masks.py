"""Ring attention's masks as key intervals: what a causal, padded or packed (several documents in
one sequence) mask says, in two integers a query row, never as a (rows, keys) matrix per layer.

Such masks let every query row see one contiguous run of keys: ``[0, q]`` causal, ``[0, min(q,
n - 1)]`` with n tokens before right padding, ``[start of q's document, q]`` for packed documents.
`intervals` reads a mask that is exactly that (boolean, or additive with only 0 and -inf; one head;
its rows this rank's) into a (batch, 1, rows, 2) tensor of global key positions ``[lo, hi]`` (an
empty run: lo > hi), once per mask object: transformers builds one mask a forward and passes it to
every layer, so the layers after the first reuse the result. Ring attention then keeps no mask for
backward, balances the rows (zigzag) when the intervals are causal (no row sees a later key), skips
the blocks no row of a pair sees, runs the fused kernel without a mask on blocks every row sees
whole (or as a causal diagonal), and computes a block a document or padding boundary crosses
(MASKED) only where some row sees a key: `ring_tiles` splits it, each tile's additive mask (tile
rows x tile keys) built for that tile's computation alone.
Any other mask (per-head, biases, holes) takes the general path (its rows sliced per block).
"""
from __future__ import annotations

import weakref
from typing import List, Optional, Tuple

import torch

__all__ = ["intervals", "plan_blocks", "classify", "block_mask", "FULL", "DIAG", "MASKED"]

FULL, DIAG, MASKED = "full", "diag", "masked"
_ROWS_BYTES = 1 << 25  # the temporaries of one row chunk when reading a mask
_cache: List[tuple] = []  # (weak mask, version, data_ptr, shape, key, result): the last mask read


def intervals(mask: torch.Tensor, total_keys: int, key) -> Optional[torch.Tensor]:
    """(B, 1, rows, 2) int64 ``[lo, hi]`` of the keys each row of `mask` sees (global positions), or
    None when `mask` is not such a mask. `key` distinguishes callers of the same mask (the ranks)."""
    if _cache:
        ref, version, ptr, shape, k, result = _cache[0]
        if ref() is mask and mask._version == version and mask.data_ptr() == ptr and tuple(mask.shape) == shape \
                and k == key:
            return result
    result = _read(mask, total_keys)
    _cache[:] = [(weakref.ref(mask), mask._version, mask.data_ptr(), tuple(mask.shape), key, result)]
    return result


def _read(mask: torch.Tensor, total_keys: int) -> Optional[torch.Tensor]:
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.shape[1] != 1 or mask.shape[-1] != total_keys:
        return None
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == float("-inf"))).all()):
            return None  # a bias, not a mask
    b, _, rows, keys = mask.shape
    step = max(1, _ROWS_BYTES // max(1, 8 * b * keys))
    idx = torch.arange(keys, device=mask.device)
    parts = []
    for r in range(0, rows, step):
        m = mask[:, :, r:r + step]
        seen = m if m.dtype == torch.bool else m == 0
        lo = torch.where(seen, idx, keys).amin(-1)
        hi = torch.where(seen, idx, -1).amax(-1)
        count = seen.sum(-1)
        if not bool(((count == 0) | (count == hi - lo + 1)).all()):
            return None  # a row with a hole
        parts.append(torch.stack([lo, hi], dim=-1))
    return torch.cat(parts, dim=2)


def plan_blocks(q_chunks, k_chunks, chunk: int, iv_parts) -> List[Tuple[int, int, str]]:
    """(q part, k part, kind) of the blocks some row sees, given each q part's intervals: FULL (every
    row sees every key of the block), DIAG (the causal diagonal: every row sees the block's keys up to
    itself), MASKED (a boundary crosses it; `ring_tiles` computes only its part some row sees)."""
    out = []
    for i, cq in enumerate(q_chunks):
        for j, ck in enumerate(k_chunks):
            kind = classify(iv_parts[i], cq * chunk, ck * chunk, chunk)
            if kind is not None:
                out.append((i, j, kind))
    return out


def classify(iv: torch.Tensor, row0: int, k0: int, width: int) -> Optional[str]:
    """The kind of the block of keys ``[k0, k0 + width)`` for rows with intervals `iv` (global
    positions from `row0`): None when no row sees any of its keys, else FULL, DIAG or MASKED."""
    lo, hi = iv[..., 0], iv[..., 1]
    k1 = k0 + width - 1
    if bool(((hi < k0) | (lo > k1) | (lo > hi)).all()):
        return None
    if bool(((lo <= k0) & (hi >= k1)).all()):
        return FULL
    if row0 == k0 and iv.shape[-2] == width and bool((lo <= k0).all()) and \
            bool((hi == torch.arange(k0, k1 + 1, device=hi.device)).all()):
        return DIAG
    return MASKED


def block_mask(iv_part: torch.Tensor, k0: int, width: int, dtype) -> torch.Tensor:
    """The additive (B, 1, rows, width) mask of keys ``[k0, k0 + width)`` for rows with intervals
    `iv_part` (0 where seen, -inf elsewhere): one block's, made for its computation and dropped."""
    pos = torch.arange(k0, k0 + width, device=iv_part.device)
    seen = (pos >= iv_part[..., :1]) & (pos <= iv_part[..., 1:])
    return torch.zeros(seen.shape, dtype=dtype, device=iv_part.device).masked_fill_(~seen, float("-inf"))


def causal_like(iv: torch.Tensor, first_row: int) -> bool:
    """No row sees a later key (rows contiguous from global position `first_row`): the work per row
    grows along the sequence, so the rows are worth balancing."""
    pos = torch.arange(first_row, first_row + iv.shape[-2], device=iv.device)
    return bool((iv[..., 1] <= pos).all())
