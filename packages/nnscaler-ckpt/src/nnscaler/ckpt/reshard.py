"""Assembling the values of any region of a full tensor from the pieces a checkpoint holds:
what lets a checkpoint of one plan load into another (resharding on load) and what merge uses.

Model pieces: for each value-split part ``j`` the distinct pieces (by slices) tile the full tensor;
the region is filled part by part and the parts are summed. Optimizer pieces: element-wise state
is a flat range ``[start, stop)`` of a local tensor (ZeRO) or the whole local tensor; per-parameter
state (Adam's ``step``) is taken from any piece. Every element asked for must be covered.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .errors import CheckpointError
from .records import ModelPiece, OptimizerPiece
from .sources import Sources

__all__ = ["intersect", "model_region", "model_segments", "optimizer_region", "optimizer_segments", "Region"]

Region = Tuple[Tuple[int, int], ...]


def intersect(a: Region, b: Region) -> Optional[Region]:
    """The common part of two regions of one tensor, or None when they do not meet."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def _relative(region: Region, origin: Region) -> Tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(region, origin))


def _volume(region: Region) -> int:
    return math.prod(hi - lo for lo, hi in region)


def _shape(region: Region) -> Tuple[int, ...]:
    return tuple(hi - lo for lo, hi in region)


def _fill(target: torch.Tensor, origin: Region, parts, what: str) -> None:
    """Copy (region, read) parts into `target` (region `origin`), reading one part at a time;
    check every element is covered."""
    covered, regions = 0, []
    for region, read in parts:
        covered += _volume(region)
        regions.append(region)
        target[_relative(region, origin)] = read().to(target.dtype)
    if covered != _volume(origin):
        mask = torch.zeros(_shape(origin), dtype=torch.bool)
        for region in regions:
            mask[_relative(region, origin)] = True
        if not bool(mask.all()):
            raise CheckpointError(f"the checkpoint holds no values for {int((~mask).sum())} elements of {what}: "
                                  f"files of some ranks are missing from it; use a complete checkpoint")


def model_region(src: Sources, names: Sequence[str], full_shape: Tuple[int, ...], region: Region,
                 dtype: torch.dtype) -> torch.Tensor:
    """The full values of `region` of the tensor called `names[0]` (or one of its aliases)."""
    name = next((n for n in names if n in src.model), None)
    if name is None:
        raise CheckpointError(f"{src.root}: the checkpoint has no tensor {names[0]!r}: it was saved from another "
                              f"model; load a checkpoint of this model")
    recs = src.model[name]
    if tuple(recs[0].full_shape) != tuple(full_shape):
        raise CheckpointError(f"{src.root}: {name!r} has shape {tuple(recs[0].full_shape)} in the checkpoint, the "
                              f"model's is {tuple(full_shape)}: load a checkpoint of this model")
    parts: Dict[Tuple[int, int], Dict[Region, ModelPiece]] = {}
    for rec in recs:  # own rank's pieces first: they win among copies of the same piece
        parts.setdefault(tuple(rec.value_split), {}).setdefault(rec.slices, rec)
    if len(parts) != recs[0].value_split[1]:
        raise CheckpointError(f"{src.root}: {name!r} is stored in {recs[0].value_split[1]} value parts but only "
                              f"{len(parts)} are there: use a complete checkpoint")
    if len(parts) == 1:  # one piece that is exactly the region: read it as it is
        rec = next(iter(parts.values())).get(tuple(tuple(r) for r in region))
        if rec is not None and rec.dtype == str(dtype).replace("torch.", ""):
            return src.read(rec)
    out: Optional[torch.Tensor] = None
    for split, pieces in parts.items():
        tmp = torch.empty(_shape(region), dtype=dtype)
        _fill(tmp, region, _reads(src, region, pieces.items()), f"{name}{list(region)} (value part {split[0]})")
        out = tmp if out is None else out.add_(tmp)
    return out


def model_segments(src: Sources, names: Sequence[str], full_shape: Tuple[int, ...], dtype: str):
    """The byte ranges whose concatenation is the whole tensor, when its pieces are one value part
    cut along dim 0 only (or one whole piece) in dtype `dtype`; None otherwise (then assemble it)."""
    name = next((n for n in names if n in src.model), None)
    if name is None:
        return None
    recs = src.model[name]
    if tuple(recs[0].full_shape) != tuple(full_shape) or any(r.value_split[1] != 1 or r.dtype != dtype
                                                             for r in recs):
        return None
    rows: Dict[Tuple[int, int], ModelPiece] = {}
    for rec in recs:
        region = rec.slices
        if region[1:] != tuple((0, d) for d in full_shape[1:]):
            return None
        rows.setdefault(region[0] if region else (0, 1), rec)
    pos, order = 0, []
    for (lo, hi), rec in sorted(rows.items()):
        if lo != pos and hi > pos:  # overlapping pieces: leave it to the general path
            return None
        if hi > pos:
            order.append(rec)
            pos = hi
    if pos != (full_shape[0] if full_shape else 1):
        return None
    return [src.byte_range(rec) for rec in order if _volume(rec.slices)]


def optimizer_segments(src: Sources, name: str, state: str, full_shape: Tuple[int, ...], dtype: str):
    """The byte ranges whose concatenation is optimizer state `state` of `name` at its full shape,
    when its source local tensors are cut along dim 0 only (or whole) and each is stored whole
    (``local``) or as ZeRO ranges that tile it (``flat``: a local tensor's ranges concatenated
    are its bytes, row-major), all in dtype `dtype`; None otherwise (then assemble it)."""
    recs = src.optim[(name, state)]
    if any(r.kind not in ("flat", "local") or r.dtype != dtype for r in recs):
        return None
    by_local: Dict[Region, List[OptimizerPiece]] = {}
    for rec in recs:
        if rec.slices[1:] != tuple((0, d) for d in full_shape[1:]):
            return None
        by_local.setdefault(rec.slices, []).append(rec)
    pos, out = 0, []
    for local in sorted(by_local, key=lambda r: r[0] if r else (0, 1)):
        lo, hi = local[0] if local else (0, 1)
        if hi <= pos:
            continue  # the same rows held twice (replicas)
        if lo != pos:
            return None
        pieces = by_local[local]
        whole = next((r for r in pieces if r.kind == "local"), None)
        if whole is not None:
            out.append(whole)
        else:
            at = 0
            for rec in sorted(pieces, key=lambda r: (r.start, r.stop)):
                if rec.stop <= at:
                    continue  # a range held twice
                if rec.start != at:
                    return None
                out.append(rec)
                at = rec.stop
            if at != _volume(local):
                return None
        pos = hi
    if pos != (full_shape[0] if full_shape else 1):
        return None
    return [src.byte_range(rec) for rec in out if (rec.stop - rec.start if rec.kind == "flat" else _volume(rec.slices))]


def _reads(src: Sources, region: Region, pieces):
    """(common region, reader) of every piece meeting `region`, read lazily."""
    for piece_region, rec in pieces:
        common = intersect(region, piece_region)
        if common is not None:
            rel = tuple((lo - o, hi - o) for (lo, hi), (o, _) in zip(common, piece_region))
            whole = rel == tuple((0, d) for d in _shape(piece_region))
            yield common, (lambda rec=rec, rel=None if whole else rel: src.read(rec, rel))


def _dense_local(src: Sources, recs: List[OptimizerPiece], local: Region, what: str) -> torch.Tensor:
    """One source local tensor, rebuilt from its flat (ZeRO) pieces."""
    dense = torch.empty(_volume(local), dtype=torch.float32 if recs else None)
    seen, covered = set(), 0
    for rec in recs:
        rng = (rec.start, rec.stop)
        if rng in seen:
            continue
        seen.add(rng)
        value = src.read(rec).reshape(-1)
        if dense.dtype != value.dtype:
            dense = dense.to(value.dtype)
        dense[rng[0]:rng[1]] = value
        covered += rng[1] - rng[0]
    if covered < dense.numel():
        raise CheckpointError(f"the checkpoint lacks part of the optimizer state {what}: files of some ranks are "
                              f"missing from it; use a complete checkpoint")
    return dense.view(_shape(local))


def optimizer_region(src: Sources, name: str, state: str, region: Region,
                     dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Optimizer state `state` of parameter `name` over `region` (element-wise), or its
    per-parameter value (a scalar state)."""
    recs = src.optim[(name, state)]
    if recs[0].kind == "scalar":
        return src.read(recs[0])
    by_local: Dict[Region, List[OptimizerPiece]] = {}
    for rec in recs:
        by_local.setdefault(rec.slices, []).append(rec)
    dtype = dtype or getattr(torch, recs[0].dtype)
    region = tuple(tuple(r) for r in region)
    if len(by_local) == 1 and region in by_local:
        whole = next((r for r in by_local[region] if r.kind == "local"), None)
        if whole is not None and whole.dtype == str(dtype).replace("torch.", ""):
            return src.read(whole)
    out = torch.empty(_shape(region), dtype=dtype)

    def reads():
        for local, pieces in by_local.items():
            common = intersect(region, local)
            if common is None:
                continue
            whole = next((r for r in pieces if r.kind == "local"), None)
            rel = tuple((lo - o, hi - o) for (lo, hi), (o, _) in zip(common, local))
            if whole is not None:
                full = rel == tuple((0, d) for d in _shape(local))
                yield common, (lambda w=whole, r=None if full else rel: src.read(w, r))
            else:
                yield common, (lambda p=pieces, loc=local, r=rel: _dense_local(src, p, loc, f"{state} of {name}")[
                    tuple(slice(a, b) for a, b in r)])
    _fill(out, region, reads(), f"the optimizer state {state} of {name}{list(region)}")
    return out
