"""Ring attention: ``scaled_dot_product_attention`` with the sequence split over a unit's ranks.

Under the `cp` policy every op is split along the sequence; the generated code calls
``nr.ring_attention.attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
ranks=(...))`` where one process calls ``F.scaled_dot_product_attention``. Rank i holds rows
``[i * L, (i + 1) * L)`` of q, k, v (and of the mask). The key/value blocks travel around the ring
(``isend`` to the next rank, ``irecv`` from the previous one, posted before the block in hand is
computed, so the transfer overlaps the compute); each rank merges the partial results of its
queries against every block with their log-sum-exp. Backward passes the blocks round again with
their key/value gradients, which end at their owners.

**Causal load balance.** With ``is_causal`` (and no mask) rank i's queries would see i + 1 blocks,
so the last rank would do N times the first one's work. The rows are first exchanged (one
all-to-all, `comm.exchange`) so that rank i holds sequence chunks i and 2N-1-i of 2N: every rank
then computes the same number of block pairs (one diagonal pair and one full one per chunk), and
the output is exchanged back.

**Masks.** A causal, padding or packed-documents mask is read as key intervals (`ring_masks`): its
rows are balanced as causal ones, blocks no row sees are skipped, and a block a boundary crosses is
computed in tiles where some row sees a key (`ring_tiles`; the same tiles in backward, the merge on
their rows only); the ring still sends one transfer per block. Other masks are sliced per block.

Each block runs the fused CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``: no
(L, L) matrix, its log-sum-exp returned), its backward the matching kernel given the merged output
and log-sum-exp (which makes each block's gradients exactly its share); on other devices a plain
matrix implementation. A value head size other than the query / key one (DeepSeek-V3's MLA) runs the
fused kernel on zero-padded heads (one head size for q, k and v: no score or statistic changes) and
drops the padded columns of the output and gradients. Values match one process's
``scaled_dot_product_attention`` (float64: within 1e-12), and so does the output's memory layout:
the query's, as the CPU kernel's (with transformers' (batch, sequence, heads, dim) projections the
model's ``transpose(1, 2).contiguous()`` after attention is then a view).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.autograd import Function

from . import failures
from .comm.primitives import CommError, as_ranks, resolve
from . import ring_masks
from .ring_layout import cat_like, chunks, zigzag
from . import ring_tiles
from .ring_masks import DIAG, FULL, MASKED
from .ring_tiles import Tile

__all__ = ["attention", "FUSED_CPU_KERNEL", "WORK"]

WORK = {"calls": 0, "blocks": 0, "pairs": 0}
"""What this process's ring attention forwards computed: calls, kernel calls (blocks and the tiles of
masked blocks, `ring_tiles`), and the (query row, key) pairs they computed (a causal diagonal those on
and below it; a skipped block or tile counts nothing): the load balance across a unit's ranks (tests,
bench/long_context_packing.py). Reset it by assigning zeros."""
FUSED_CPU_KERNEL = True
"""CPU blocks run torch's fused flash kernel; False: the matrix implementation other devices run
(the tests run both paths on the CPU)."""


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
              ranks) -> torch.Tensor:
    """This rank's rows of ``F.scaled_dot_product_attention`` over the whole sequence (see the
    module docstring). COLLECTIVE over `ranks`."""
    ranks = as_ranks(ranks)
    if dropout_p:
        raise CommError(f"ring attention (pas_policy 'cp') does not run attention dropout (dropout_p="
                        f"{dropout_p}): set the model's attention dropout to 0")
    if query.dim() != 4 or key.dim() != 4:
        raise CommError(f"ring attention takes (batch, heads, sequence, head_dim) tensors, got query "
                        f"{tuple(query.shape)} and key {tuple(key.shape)}")
    if key.shape[-1] != query.shape[-1] or value.shape[:-1] != key.shape[:-1]:
        raise CommError(f"ring attention: key {tuple(key.shape)} must have the query's head size "
                        f"({query.shape[-1]}) and value {tuple(value.shape)} the key's batch, heads and sequence")
    if query.shape[1] % key.shape[1]:
        raise CommError(f"ring attention: {query.shape[1]} query heads are not a multiple of {key.shape[1]} kv heads")
    rs = resolve(ranks, "ring_attention.attention")
    scale = float(scale) if scale is not None else query.shape[-1] ** -0.5
    if is_causal and attn_mask is not None:
        raise CommError("ring attention: is_causal with an attn_mask (as scaled_dot_product_attention, refused)")
    rows = query.shape[-2]
    iv = None if attn_mask is None else ring_masks.intervals(attn_mask, rows * rs.n, rs.ranks)
    mask = _additive(attn_mask, query.dtype) if attn_mask is not None and iv is None else None
    if iv is not None and iv.shape[-2] != rows:  # a mask broadcast over the rows (key padding only)
        iv = iv.expand(*iv.shape[:-2], rows, 2).contiguous()
    balanced = rs.n > 1 and (bool(is_causal) or (iv is not None and ring_masks.causal_like(iv, rs.index * rows)))
    if balanced and rows % 2:
        if iv is None:
            raise CommError(f"ring attention: the local sequence ({rows} rows) does not split into 2 "
                            f"chunks: the sequence length must be a multiple of {2 * rs.n} (2 x the cp size)")
        balanced = False  # a mask's intervals run unbalanced
    holder: Optional[list] = None
    if balanced:
        like = query  # the output takes the caller's query layout (as F.scaled_dot_product_attention's)
        query, key, value = (zigzag(t, rs, forward=True) for t in (query, key, value))
        iv = zigzag(iv, rs, forward=True) if iv is not None else None
        holder = []  # the output in the caller's order, which backward exchanges again instead of keeping a copy
    out = _Ring.apply(query, key, value, mask, iv, bool(is_causal), balanced, scale, rs, holder)
    if not balanced:
        return out
    out = zigzag(out, rs, forward=False, like=like)
    holder += [out.detach(), out._version]  # shares its storage with what the model keeps (o_proj's input)
    return out


def _pairs(q_chunks: List[int], k_chunks: List[int], causal: bool) -> List[Tuple[int, int, str]]:
    """(q part, k part, kind) to compute: all pairs, or under causality those with k <= q."""
    out = []
    for i, cq in enumerate(q_chunks):
        for j, ck in enumerate(k_chunks):
            if not causal or ck < cq:
                out.append((i, j, FULL))
            elif ck == cq:
                out.append((i, j, DIAG))
    return out


# -- one block -------------------------------------------------------------------------------------

def _additive(mask, dtype) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return t
    b, h, length, d = t.shape
    return t.view(b, h // groups, groups, length, d).sum(2)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the softmax statistics, the merge and the gradient sums: float32 for bfloat16 /
    float16 inputs (as the fused kernels accumulate), else the input's."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _block_forward(q, k, v, mask, diag: bool, scale: float):
    """(out, lse) of softmax(q k^T * scale + mask) v, both in `_acc_dtype`; rows that see no key get
    lse = -inf. On the CPU the fused kernel runs in the input dtype (it accumulates in float32 and
    returns its log-sum-exp in float32); its output, rounded once to the input dtype, is merged in
    float32. Elsewhere the scores, the softmax and the product run in float32."""
    acc = _acc_dtype(q.dtype)
    if q.device.type == "cpu" and FUSED_CPU_KERNEL:
        d = max(q.shape[-1], v.shape[-1])  # the kernel wants one head size: zeros change no score, no row
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _pad(q, d), _pad(k, d), _pad(v, d), 0.0, diag, attn_mask=mask, scale=scale)
        out, lse = out[..., :v.shape[-1]].to(acc), lse.to(acc)
    else:
        s = _scores(q.to(acc), k.to(acc), mask, diag, scale)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0) @ v.to(acc)
    if mask is not None:  # a row whose keys in this block are all masked contributes nothing
        seen = _seen(mask).expand(lse.shape)
        lse = lse.masked_fill(~seen, float("-inf"))
        out = out.masked_fill(~seen.unsqueeze(-1), 0.0)
    return out, lse


def _pad(t: torch.Tensor, d: int) -> torch.Tensor:
    """`t` with zero columns appended up to head size `d` (itself when it has `d`): the fused CPU
    kernel takes one head size for q, k and v, DeepSeek-V3's MLA has a value head size
    (v_head_dim) other than the query / key one (qk_nope_head_dim + qk_rope_head_dim)."""
    return t if t.shape[-1] == d else torch.nn.functional.pad(t, (0, d - t.shape[-1]))


def _seen(mask):
    """Rows of a block mask with at least one visible key."""
    return mask.any(dim=-1) if mask.dtype == torch.bool else torch.isfinite(mask).any(dim=-1)


def _block_backward(dout, q, k, v, out, lse, mask, diag: bool, scale: float):
    """(dq, dk, dv) of one block, given the merged `out` and `lse` of the rows (their global softmax);
    off the fused CPU kernel computed in float32 for low-precision inputs."""
    if q.device.type == "cpu" and FUSED_CPU_KERNEL:
        dqk, dv = q.shape[-1], v.shape[-1]
        d = max(dqk, dv)  # as `_block_forward`: the padded columns' gradients are dropped
        dq, dk, dv_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _pad(dout, d), _pad(q, d), _pad(k, d), _pad(v, d), _pad(out, d), lse, 0.0, diag, attn_mask=mask,
            scale=scale)
        return dq[..., :dqk], dk[..., :dqk], dv_[..., :dv]
    acc = _acc_dtype(q.dtype)
    q, k, v, dout, out = (t.to(acc) for t in (q, k, v, dout, out))
    p = torch.exp(_scores(q, k, mask, diag, scale) - lse.to(acc).unsqueeze(-1)).nan_to_num(0.0)
    dv = p.transpose(-1, -2) @ dout
    dp = dout @ v.transpose(-1, -2)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, dv


def _scores(q, k, mask, diag, scale):
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    if diag:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


# -- the ring --------------------------------------------------------------------------------------

class _Ring(Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, iv, causal, balanced, scale, rs, holder):
        n, me = rs.n, rs.index
        groups = q.shape[1] // k.shape[1]
        q_chunks = chunks(me, n, balanced)
        q_parts = torch.chunk(q, len(q_chunks), dim=-2)
        iv_parts = torch.chunk(iv, len(q_chunks), dim=-2) if iv is not None else None
        acc: List[Optional[Tuple[torch.Tensor, torch.Tensor]]] = [None] * len(q_parts)
        block = (k, v)
        WORK["calls"] += 1
        for step in range(n):
            src = (me - step) % n
            pending = _shift(block, rs, step) if step < n - 1 else None
            k_chunks = chunks(src, n, balanced)
            k_parts, v_parts = torch.chunk(block[0], len(k_chunks), -2), torch.chunk(block[1], len(k_chunks), -2)
            width = k_parts[0].shape[-2]
            for i, j, kind in _blocks(q_chunks, k_chunks, causal, iv_parts, width):
                kb, vb = _expand(k_parts[j], groups), _expand(v_parts[j], groups)
                for t in _tiles(kind, iv_parts, i, q_chunks[i], k_chunks[j], width, q_parts[i].shape[-2]):
                    m = _block_mask(mask, iv_parts, i, t, k_chunks[j] * width, block[0].shape[-2], src, q.dtype)
                    o, lse = _block_forward(q_parts[i][..., t.rows, :], kb[..., t.keys, :], vb[..., t.keys, :], m,
                                            t.kind == DIAG, scale)
                    WORK["blocks"] += 1
                    WORK["pairs"] += t.pairs()
                    acc[i] = _merge_rows(acc[i], o, lse, t.rows, q_parts[i].shape[-2])
            block = _finish(pending, rs) if pending is not None else block
        outs, lses = zip(*[_final(a, p, v.shape[-1]) for a, p in zip(acc, q_parts)])
        out, lse = cat_like(outs, q, -2), torch.cat(lses, dim=-1)  # out in q's layout, as the fused kernel
        # saved: q, k, v (in the ring's row order), the log-sum-exp, the output unless the caller's
        # reordered one stands in for it (`holder`), the general mask or the intervals (two ints a row)
        extra = [t for t in (mask, iv) if t is not None]
        ctx.save_for_backward(q, k, v, lse, *([] if holder is not None else [out]), *extra)
        ctx.flags = (causal, balanced, scale, rs, mask is not None, iv is not None)
        ctx.holder = holder
        return out

    @staticmethod
    def backward(ctx, dout):
        causal, balanced, scale, rs, has_mask, has_iv = ctx.flags
        q, k, v, lse, *rest = ctx.saved_tensors
        if ctx.holder is not None:
            kept, version = ctx.holder
            if kept._version != version:
                raise CommError("ring attention: its output was modified in place after the call; backward needs "
                                "it as returned (copy it before modifying it)")
            out = zigzag(kept, rs, forward=True)  # the caller's output, back in the ring's order
        else:
            out, rest = rest[0], rest[1:]
        mask = rest.pop(0) if has_mask else None
        iv = rest.pop(0) if has_iv else None
        n, me = rs.n, rs.index
        groups = q.shape[1] // k.shape[1]
        q_chunks = chunks(me, n, balanced)
        split = lambda t, dim=-2: torch.chunk(t, len(q_chunks), dim=dim)  # noqa: E731
        q_parts, o_parts, do_parts, l_parts = split(q), split(out), split(dout.contiguous()), split(lse, -1)
        iv_parts = split(iv) if iv is not None else None
        acc = _acc_dtype(q.dtype)  # gradient sums (and the dk / dv passed round) in float32 for bf16 / fp16
        dq_parts = [torch.zeros_like(p, dtype=acc) for p in q_parts]
        block = (k, v, torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc))
        for step in range(n):
            src = (me - step) % n
            k_chunks = chunks(src, n, balanced)
            kb, vb, dkb, dvb = (torch.chunk(t, len(k_chunks), -2) for t in block)
            width = kb[0].shape[-2]
            for i, j, kind in _blocks(q_chunks, k_chunks, causal, iv_parts, width):
                kx, vx = _expand(kb[j], groups), _expand(vb[j], groups)
                for t in _tiles(kind, iv_parts, i, q_chunks[i], k_chunks[j], width, q_parts[i].shape[-2]):
                    m = _block_mask(mask, iv_parts, i, t, k_chunks[j] * width, block[0].shape[-2], src, q.dtype)
                    r, c = t.rows, t.keys
                    dq, dk, dv = _block_backward(do_parts[i][..., r, :], q_parts[i][..., r, :], kx[..., c, :],
                                                 vx[..., c, :], o_parts[i][..., r, :], l_parts[i][..., r], m,
                                                 t.kind == DIAG, scale)
                    dq_parts[i][..., r, :] += dq
                    dkb[j][..., c, :].add_(_fold(dk.to(acc), groups))
                    dvb[j][..., c, :].add_(_fold(dv.to(acc), groups))
            if step < n - 1:
                block = _finish(_shift(block, rs, n + step), rs)
        dk, dv = block[2], block[3]
        if n > 1:  # the gradients of the block in hand belong to the next rank: send them home
            dk, dv = _finish(_shift((dk, dv), rs, 2 * n), rs)
        dq = torch.cat(dq_parts, dim=-2).to(q.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


def _blocks(q_chunks, k_chunks, causal, iv_parts, chunk: int):
    """The blocks to compute: from the intervals of a mask read as such, else all pairs (causal:
    those with k <= q)."""
    if iv_parts is not None:
        return ring_masks.plan_blocks(q_chunks, k_chunks, chunk, iv_parts)
    return _pairs(q_chunks, k_chunks, causal)


def _tiles(kind, iv_parts, i, q_chunk, k_chunk, width, rows) -> List[Tile]:
    """The parts of a block to compute: the whole block, or a MASKED one's tiles (`ring_tiles`)."""
    if kind == MASKED:
        return ring_tiles.tiles(iv_parts[i], q_chunk * rows, k_chunk * width, width)
    return [Tile(slice(0, rows), slice(0, width), kind)]


def _block_mask(mask, iv_parts, i, tile, k0, block_width, src, dtype):
    """A MASKED tile's additive mask from its rows' intervals (keys from global position `k0` + the
    tile's offset), None for the other kinds, else the general mask's key block."""
    if tile.kind == MASKED:
        start, stop = tile.keys.start, tile.keys.stop
        return ring_masks.block_mask(iv_parts[i][..., tile.rows, :], k0 + start, stop - start, dtype)
    if iv_parts is not None:
        return None
    return _mask_block(mask, block_width, src)


def _mask_block(mask, width: int, src: int):
    """The mask's columns of the key block of piece `src` (contiguous layout)."""
    if mask is None:
        return None
    if mask.shape[-1] == 1:
        return mask
    return mask[..., src * width:(src + 1) * width]


def _merge(acc, o, lse):
    if acc is None:
        return o, lse
    out, total = acc
    new = torch.logaddexp(total, lse)
    keep = torch.where(torch.isfinite(new), torch.exp(total - new), torch.zeros_like(new))
    take = torch.where(torch.isfinite(new), torch.exp(lse - new), torch.zeros_like(new))
    return out * keep.unsqueeze(-1) + o * take.unsqueeze(-1), new


def _merge_rows(acc, o, lse, rows: slice, total: int):
    """`_merge` of a tile's (o, lse) into rows `rows` of its query part's (`total` rows): the other
    rows' output and log-sum-exp stay as they are (none yet: 0 and -inf)."""
    if rows.stop - rows.start == total:
        return _merge(acc, o, lse)
    if acc is None:
        acc = (o.new_zeros(*o.shape[:-2], total, o.shape[-1]), lse.new_full((*lse.shape[:-1], total), float("-inf")))
    out, sums = acc
    part, part_sums = _merge((out[..., rows, :], sums[..., rows]), o, lse)
    out[..., rows, :] = part
    sums[..., rows] = part_sums
    return out, sums


def _final(acc, q_part, dv: int):
    """Rows no key reached: output 0 (value head size `dv`) and log-sum-exp 0 (as the fused kernel
    reports them)."""
    if acc is None:
        shape = q_part.shape
        return q_part.new_zeros(*shape[:-1], dv), q_part.new_zeros(shape[:-1], dtype=_acc_dtype(q_part.dtype))
    out, lse = acc
    return out.to(q_part.dtype), torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def _shift(tensors, rs, tag: int):
    """Send `tensors` to the next piece and receive the same shapes from the previous one (posted
    at once; `_finish` waits)."""
    nxt, prev = rs.ranks[(rs.index + 1) % rs.n], rs.ranks[(rs.index - 1) % rs.n]
    ops, received = [], []
    for t in tensors:
        t = t.contiguous()
        buf = torch.empty_like(t)
        received.append(buf)
        ops.append(dist.P2POp(dist.irecv, buf, prev, rs.group, tag))
        ops.append(dist.P2POp(dist.isend, t, nxt, rs.group, tag))
    return received, dist.batch_isend_irecv(ops), tensors


def _finish(pending, rs) -> tuple:
    received, works, _sent = pending
    what = f"the ring attention's block exchange over ranks {rs.ranks}"
    for work in works:
        failures.wait(work, what, rs.group, received[0])
    return tuple(received)
