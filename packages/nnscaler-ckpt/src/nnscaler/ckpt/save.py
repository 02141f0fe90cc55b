"""`save`: the collective that writes a sharded or deduped checkpoint, in the caller.

A save is planned (`plan.plan_save`: every rank's records, the deduped pieces, the staging
directory; collective) and executed by the one writer (`executor.execute`) with the ranks meeting
over the process group (`rendezvous.Collective`). A rank file of at most 64 MiB (`_INLINE`) is
hashed with SHA-256 while it is written; a larger one with its chunked CRC-32 only, its SHA-256
and the deletion of a large checkpoint this save replaced being left to rank 0's thread after
the commit (`after_commit`): hashing while writing doubled the time of a save. A failure on any
rank (a full disk, a bad ``extra``) makes every rank raise and leaves no checkpoint behind.
`async_save` plans the same way and executes the same writer in a background process.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

import torch

from .errors import CheckpointError
from .executor import execute
from .inflight import OWNER
from .plan import plan_save
from .rendezvous import Collective

__all__ = ["save"]

_INLINE = 64 * 2**20  # larger: a rank file's SHA-256, a replaced checkpoint's deletion wait for after the commit


def save(path, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
         kind: str = "sharded", extra: Optional[Dict[str, Any]] = None, overwrite: bool = False,
         files: Optional[Mapping[str, Union[bytes, str]]] = None) -> Path:
    """Write a checkpoint of `module` (and `optimizer`, `extra`) to directory `path`. COLLECTIVE:
    every rank calls it with the same `path`, `kind` and `files`. `files` (name -> bytes or str)
    are small files of the caller (a run's config), written by rank 0 into the same directory,
    listed with their hashes in the manifest and committed with it. Returns the path. What is in
    flight in this process (an `async_save`, the work after the previous commit) is waited for first."""
    OWNER.settle()
    plan, tensors = plan_save(path, module, optimizer, kind=kind, extra=extra, overwrite=overwrite, files=files,
                              after_commit=_INLINE)
    error = execute(plan, tensors, Collective())
    if error:
        raise CheckpointError(error)
    return Path(plan.dest)
