"""use_zero=3 with tensors several pipeline stages hold (an embedding tied to the output head).

Each holder stage keeps the tensor in a root unit of its own, built alike on every holder (the
same tensors in full-name order), sharded over the stage's zero group like any other unit, so rank
i of every holder's zero group keeps the same elements. Backward reduce-scatters each stage's part
of the gradient in its zero group, as for any unit; at the step, `sum_shared` adds the holders'
shard gradients (and their "has a gradient" flags) over the group joining the ranks of one
data-parallel unit on the holders (`pipeline_grads.zero3_cross_groups`): every holder then steps
on the full gradient, and the copies stay equal. Summed at the step, not in backward: a pipeline
schedule runs the stages' backward passes at different times, and a collective between them there
could wait for a stage that waits for it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import failures
from .comm.stats import record

__all__ = ["sum_shared"]


def sum_shared(engine) -> None:
    """Sum the shard gradients of `engine`'s units several pipeline stages hold over the holders.
    COLLECTIVE over each such unit's group, in one order on every holder (by holders, then dtype:
    the unit's key, as `FullyShardedParams` builds it)."""
    units = sorted((u for u in engine.units if u.cross is not None and u.trainable),
                   key=lambda u: (u.cross[0], str(u.dtype)))
    for u in units:
        width = u.shard_numel
        buffer = torch.zeros(width + len(u.params), dtype=u.dtype, device=u.device)
        if u.shard.grad is not None:
            buffer[:width].copy_(u.shard.grad)
        buffer[width:] = u.used.to(u.dtype)
        record("zero_all_reduce", buffer.nbytes)
        failures.run(dist.all_reduce, buffer, group=u.cross[1], what="the pipeline-shared shard gradient all-reduce")
        u.shard.grad = buffer[:width]
        u.used = buffer[width:] > 0
