"""`inspect(path)`: what a checkpoint holds, as a plain dict (the CLI renders it as a table)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict

import torch

from .manifest import read_manifest

__all__ = ["inspect"]


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def inspect(path) -> Dict[str, Any]:
    """Kind, format version, world size, plan, optimizer, files and, per full tensor: shape,
    dtype, number of stored pieces and their bytes; plus totals; ``rng_ranks``: the ranks whose
    RNG states it holds (`load` restores them on the same world size). Reads only the manifest."""
    root = Path(path)
    m = read_manifest(root)
    tensors: Dict[str, Dict[str, Any]] = {}
    for name, info in m.tensors.items():
        tensors[name] = {"name": name, "shape": list(info.shape), "dtype": info.dtype, "pieces": 0, "bytes": 0,
                         "numel": math.prod(info.shape)}
    for rec in m.model:
        t = tensors.setdefault(rec.full_name, {"name": rec.full_name, "shape": list(rec.full_shape),
                                               "dtype": rec.dtype, "pieces": 0, "bytes": 0,
                                               "numel": math.prod(rec.full_shape)})
        t["pieces"] += 1
        t["bytes"] += math.prod(b - a for a, b in rec.slices) * _itemsize(rec.dtype)
    return {
        "path": str(root), "kind": m.kind, "format_version": m.format_version, "world_size": m.world_size,
        "created": m.created, "plan": None if m.plan is None else [p.to_json() for p in m.plan],
        "optimizer": m.optimizer.cls if m.optimizer else None,
        "optimizer_states": sorted({r.state for r in m.optimizer_state}),
        "files": {name: rec.size for name, rec in m.files.items()},
        "file_bytes": sum(rec.size for rec in m.files.values()),
        "tensors": sorted(tensors.values(), key=lambda t: t["name"]),
        "parameters": sum(t["numel"] for t in tensors.values()),
        "model_bytes": sum(t["bytes"] for t in tensors.values()),
        "rng_ranks": [i for i, r in enumerate(m.ranks) if r.rng],
    }
