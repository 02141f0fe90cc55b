"""The one writer of a save: it executes a `SavePlan` (as torch.distributed.checkpoint's storage
writer executes its planner's plan), whether in the caller (`save`) or in the background process
(`async_save`); only the way the ranks meet differs (`rendezvous`).

Each rank streams its file into the staging directory, hashing it as it writes (the chunked
CRC-32, and the SHA-256 when the plan says so) and fsyncing it (`safetensors_file`); rank 0 also
writes the caller's small files. The ranks meet; rank 0 fills the manifest's file records, checks
that the destination may still be replaced and commits (`commit.StagingDir`: manifest last,
rename or exchange, fsyncs) — the one commit — or deletes the staging directory when any rank
failed. Every rank returns the same verdict. What the plan leaves for after the commit (the
SHA-256 of large files, the deletion of a large replaced checkpoint) goes to rank 0's thread
(`after_commit`), which the in-flight owner (`inflight`) tracks.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import torch

from . import after_commit
from .checksums import bytes_record
from .commit import StagingDir
from .errors import CheckpointError, describe
from .plan import SavePlan
from .rendezvous import Collective, Markers, RankOutcome
from .replace_guard import check_save_destination
from .safetensors_file import write_record

__all__ = ["execute"]

Rendezvous = Union[Collective, Markers]


def execute(plan: SavePlan, tensors: Sequence[Tuple[str, torch.Tensor]], rendezvous: Rendezvous) -> Optional[str]:
    """Write this rank's part of `plan` (`tensors`, in the plan's order), meet the other ranks and,
    on rank 0, commit. Returns None once the checkpoint is committed, else the error every rank
    reports (nothing is left at the destination then; the previous checkpoint is intact)."""
    staging = plan.staging
    mine = _write(plan, staging, tensors)
    outcomes = rendezvous.gather(plan, mine)
    error: Optional[str] = None
    dir_fd: Optional[int] = None
    if plan.rank == 0:
        error = next((o.error for o in outcomes if o.error), None)
        if error is None:
            error, dir_fd = _commit(plan, staging, outcomes)
        if error is not None:
            _close(dir_fd)
            dir_fd = None
            staging.discard()
    error = rendezvous.verdict(plan, mine, error)
    if error is None and plan.rank == 0 and plan.after_commit is not None:
        _leave_for_later(plan, staging, dir_fd)
    return error


def _write_small(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write(plan: SavePlan, staging: StagingDir, tensors) -> RankOutcome:
    """This rank's file (and rank 0's small files) in the staging directory, fsynced."""
    try:
        records = {plan.file: write_record(staging.file(plan.file), tensors, plan.metadata, sha256=plan.sha256)}
        for name, data in plan.small.items():
            _write_small(staging.file(name), data)
            records[name] = bytes_record(data)
        return RankOutcome(plan.rank, records)
    except OSError as e:
        return RankOutcome(plan.rank, error=f"rank {plan.rank} could not write {staging.file(plan.file)} ({e}); the "
                                            f"previous checkpoint is intact")
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        return RankOutcome(plan.rank, error=describe(e, plan.rank))


def _commit(plan: SavePlan, staging: StagingDir, outcomes: List[RankOutcome]) -> Tuple[Optional[str], Optional[int]]:
    """Rank 0: the manifest with every file's record, committed; (None or the error, a descriptor
    of the checkpoint directory for the work after the commit, when the plan leaves some)."""
    records = {n: r for o in outcomes for n, r in o.records.items()}
    manifest = plan.manifest
    manifest.files = {n: records[n] for n in plan.file_names()}
    dir_fd = None
    if plan.after_commit is not None:
        try:
            dir_fd = after_commit.open_dir(staging.path)
        except OSError:
            dir_fd = None  # the commit will fail and say why
    try:
        check_save_destination(Path(plan.dest), plan.overwrite)  # still safe to replace
        staging.commit(manifest, keep_replaced=plan.after_commit is not None)
    except (CheckpointError, OSError) as e:
        return (str(e) if isinstance(e, CheckpointError) else f"{plan.dest}: the commit failed ({e}); the previous "
                                                              f"checkpoint is intact"), dir_fd
    return None, dir_fd


def _leave_for_later(plan: SavePlan, staging: StagingDir, dir_fd: Optional[int]) -> None:
    """Rank 0, once committed: what the plan leaves for after the commit, to the thread when there
    is some worth one (a file without its SHA-256, a replaced checkpoint over the limit), else here."""
    old = staging.replaced
    try:
        old_size = 0 if old is None else sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(old)
                                             if e.is_file(follow_symlinks=False))
    except OSError:
        old_size = 0
    unhashed = any(r.sha256 is None for r in plan.manifest.files.values())
    if not unhashed and old_size <= plan.after_commit:
        _close(dir_fd)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return
    if not unhashed:
        _close(dir_fd)
        dir_fd = None
    after_commit.start(dir_fd, old)


def _close(fd: Optional[int]) -> None:
    if fd is not None:
        os.close(fd)
