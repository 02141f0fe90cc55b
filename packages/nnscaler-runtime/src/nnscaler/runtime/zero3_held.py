"""What a rank's shards hold of each fully sharded parameter (``use_zero=3``), as the IR contract
`GeneratedAttrs.held_tensors` declares it: the checkpoint package saves and loads these ranges
where they are (views of the units' shards), so no rank gathers its local model for a checkpoint."""
from __future__ import annotations

from typing import Dict, Optional

from .zero import owned_ranges
from .zero3 import FullyShardedParams
from nnscaler.ir.contracts import HeldRange, HeldTensor

__all__ = ["held_tensors"]


def held_tensors(engine: FullyShardedParams) -> Optional[Dict[str, HeldTensor]]:
    """local name -> the part of it this rank's shard holds (possibly no range); None before the
    parameters are sharded and inside ``engine.unsharded()`` (they are whole then). No collective."""
    if not engine.sharded or engine._unsharded:
        return None
    out: Dict[str, HeldTensor] = {}
    index = engine.groups.group_index
    for u in engine.units:
        shard = u.shard.detach()
        ranges = {pos: HeldRange(a, b, shard[at:at + b - a])
                  for pos, a, b, _, at in owned_ranges(u.offsets, u.numels, u.shard_numel, index)}
        for pos, name in enumerate(u.local_names):
            out[name] = HeldTensor(u.shapes[pos], u.dtype, (ranges[pos],) if pos in ranges else ())
    return out
