"""Loading a deduped checkpoint into the plan and world size that saved it: every rank reads only
its own file; each piece another rank stored is sent by that rank (point to point, over the
default group), so no rank reads another's file.

The transfers are listed in one global order (receiver, then piece) that every rank walks, each
taking part only in its own: transfer ``i`` waits only on its two ranks, which have finished
every earlier transfer they take part in, so the walk cannot deadlock.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .collectives import _device, agree, all_gather_json
from .errors import CheckpointError
from .module_tensors import LocalTensor
from .names import rank_file
from .records import Manifest
from .sources import Region, Sources

__all__ = ["DedupSources"]


def _needed(manifest: Manifest, tensors: List[LocalTensor], rank: int) -> List[Tuple[str, int]]:
    """("model" | "optimizer_state", record index) of the pieces this rank needs from other ranks."""
    keys = {k for lt in tensors if lt.persistent for k in lt.piece_keys()}
    places = {(lt.full_name, tuple(map(tuple, lt.slices))) for lt in tensors}
    need = [("model", i) for i, r in enumerate(manifest.model) if r.piece in keys and r.rank != rank]
    need += [("optimizer_state", i) for i, r in enumerate(manifest.optimizer_state)
             if r.key is not None and r.rank != rank and (r.full_name, r.slices) in places]
    return need


class DedupSources(Sources):
    """`Sources` whose pieces stored by other ranks arrive from them (COLLECTIVE to build)."""

    def __init__(self, root, manifest: Manifest, verify, rank: int, tensors: List[LocalTensor]):
        super().__init__(root, manifest, verify, prefer_rank=rank)
        self._received: Dict[Tuple[str, int], torch.Tensor] = {}
        own = rank_file(rank, manifest.world_size)
        error: Optional[str] = None
        try:
            if own in manifest.files:
                self.handle(own)
        except CheckpointError as e:
            error = str(e)
        if not agree(error is None):
            raise CheckpointError(error or "another rank could not read its file of the deduped checkpoint; see its "
                                           "error")
        needs = all_gather_json(_needed(manifest, tensors, rank))
        device = _device() if any(needs) else None  # no transfer at all (one rank): no process group needed
        for receiver, items in enumerate(needs):
            for kind, index in items:
                rec = (manifest.model if kind == "model" else manifest.optimizer_state)[index]
                if rec.rank == rank:
                    dist.send(super().read(rec).contiguous().to(device), dst=receiver)
                elif receiver == rank:
                    buf = torch.empty(rec.shape, dtype=getattr(torch, rec.dtype), device=device)
                    dist.recv(buf, src=rec.rank)
                    self._received[(rec.file, rec.key)] = buf.cpu()

    def read_key(self, file: str, key: str, region: Optional[Region] = None) -> torch.Tensor:
        got = self._received.get((file, key))
        if got is None:
            return super().read_key(file, key, region)
        if region is None or len(region) == 0:
            return got
        return got[tuple(slice(a, b) for a, b in region)]
