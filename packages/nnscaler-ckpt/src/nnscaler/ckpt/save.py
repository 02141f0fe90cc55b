"""`save`: the collective that writes a sharded or deduped checkpoint.

Every rank describes what it holds (`rank_state.collect`); with ``kind="deduped"`` the ranks
agree (one JSON all-gather) that each distinct piece is stored by the lowest rank holding it.
Rank 0 creates the staging directory (`prepare`), every rank streams its safetensors file into it,
computing its chunked CRC-32 as it writes (`checksums`; `write_share`), and its SHA-256 too when
the file is small (at most 64 MiB), then rank 0 writes the manifest and commits
(`commit.StagingDir`). The SHA-256 of larger files and the deletion of a large checkpoint this
save replaced are left to a thread of rank 0 after the commit (`after_commit`): hashing while
writing doubled the time of a save. A failure on any rank (a full disk, a bad
``extra``) makes every rank raise and leaves no checkpoint behind. `async_save` runs the same
`prepare` in the caller and the rest in a background process.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

from . import after_commit
from .checksums import bytes_record
from .collectives import all_gather_json, broadcast_json, rank_and_world
from .commit import StagingDir, new_token
from .replace_guard import check_save_destination
from .errors import CheckpointError, describe
from .inflight import wait_in_flight
from .module_tensors import module_plans, with_whole_tensors
from .names import MANIFEST, is_staging, rank_file
from .optimizer_tensors import hyper_parameters, optimizer_class
from .rank_state import RankShare, collect, keep_only, share_of
from .records import FileRecord, Manifest, OptimizerInfo, RankRecord, TensorInfo
from .safetensors_file import write_record

__all__ = ["save", "prepare", "Prepared", "write_share", "write_error", "complete_manifest", "fill_manifest",
           "commit_prepared"]


def _owners(ids: List[List[str]]) -> Dict[str, int]:
    owner: Dict[str, int] = {}
    for rank, mine in enumerate(ids):
        for i in mine:
            owner.setdefault(i, rank)
    return owner


def _dedup(st, rank: int) -> None:
    gathered = all_gather_json([[r.piece for r in st.model], [r.piece_id for r in st.optimizer_state]])
    model_owner = _owners([g[0] for g in gathered])
    optim_owner = _owners([g[1] for g in gathered])
    keep_only(st, {i for i, r in model_owner.items() if r == rank}, {i for i, r in optim_owner.items() if r == rank})


def _tensor_table(shares: List[RankShare]) -> Dict[str, TensorInfo]:
    table: Dict[str, TensorInfo] = {}
    for share in shares:
        for rec in share.model:
            if rec.full_name not in table:
                table[rec.full_name] = TensorInfo(rec.full_shape, rec.dtype, list(rec.aliases))
    return table


def _checked_files(files: Optional[Mapping[str, Union[bytes, str]]]) -> Dict[str, bytes]:
    """`files` as name -> bytes, each name a plain file name the checkpoint does not use itself."""
    out: Dict[str, bytes] = {}
    for name, data in (files or {}).items():
        if (not isinstance(name, str) or not name or name != os.path.basename(name) or name.startswith(".")
                or name == MANIFEST or is_staging(name) or name.endswith(".safetensors")):
            raise CheckpointError(f"save(files=...): {name!r} is not a usable file name: give a plain name (no "
                                  f"directory, not hidden, not {MANIFEST} nor a .safetensors file), e.g. "
                                  f"'train_config.yaml'")
        if isinstance(data, str):
            data = data.encode("utf-8")
        if not isinstance(data, (bytes, bytearray)):
            raise CheckpointError(f"save(files=...): {name!r} holds a {type(data).__name__}; give bytes or str")
        out[name] = bytes(data)
    return out


def _write_small(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@dataclass
class Prepared:
    """A save after its collective preparation: the staging directory exists, this rank knows its
    file, its tensors and its records; rank 0 also holds `manifest` (without files and pieces yet)
    and the caller's small `files`."""

    dest: Path
    staging: StagingDir
    rank: int
    world: int
    kind: str
    overwrite: bool
    file: str
    tensors: List[Tuple[str, torch.Tensor]]
    share: RankShare
    manifest: Optional[Manifest] = None
    small: Dict[str, bytes] = field(default_factory=dict)

    @property
    def metadata(self) -> Dict[str, str]:
        return {"format": "pt", "nnscaler": f"{self.kind} checkpoint, rank {self.rank} of {self.world}"}


def prepare(path, module: torch.nn.Module, optimizer=None, *, kind: str = "sharded", extra=None,
            overwrite: bool = False, files: Optional[Mapping[str, Union[bytes, str]]] = None) -> Prepared:
    """COLLECTIVE: describe this rank's share, agree on the pieces (deduped), create the staging
    directory (rank 0). Raises the same CheckpointError on every rank when any rank fails."""
    if kind not in ("sharded", "deduped"):
        raise CheckpointError(f"save(kind={kind!r}): kind must be 'sharded' or 'deduped' (merge a checkpoint "
                              f"offline with nnscaler.ckpt.merge)")
    rank, world = rank_and_world()
    dest = Path(path).absolute()
    error: Optional[str] = None
    st = None
    small: Dict[str, bytes] = {}
    try:
        small = _checked_files(files)
        st = collect(module, optimizer, extra, rank)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
        error = describe(e, rank)
    errors = all_gather_json(error)
    if any(errors):
        raise CheckpointError(next(e for e in errors if e))
    if kind == "deduped":
        _dedup(st, rank)
    staging = StagingDir(dest, broadcast_json(new_token() if rank == 0 else None), overwrite)
    manifest = None
    if rank == 0:
        try:
            check_save_destination(dest, overwrite)
            manifest = Manifest(kind=kind, world_size=world, files={}, plan=module_plans(module),
                                created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                optimizer=None if optimizer is None else OptimizerInfo(
                                    optimizer_class(optimizer), hyper_parameters(optimizer)))
            staging.create()
        except (CheckpointError, OSError) as e:
            error = str(e) if isinstance(e, CheckpointError) else f"{dest}: cannot create the checkpoint ({e})"
    error = broadcast_json(error)
    if error:
        raise CheckpointError(error)
    name = rank_file(rank, world)
    return Prepared(dest, staging, rank, world, kind, overwrite, name, st.tensors, share_of(st, name), manifest,
                    small if rank == 0 else {})


def write_share(p: Prepared, tensors: Optional[List[Tuple[str, torch.Tensor]]] = None, *,
                sha256: bool = True) -> Dict[str, FileRecord]:
    """Write this rank's file (and rank 0 the small files) into the staging directory, fsynced;
    returns their records. `tensors`: the values to write (default `p.tensors`), e.g. copies.
    `sha256`: also the SHA-256 of this rank's file (else its size and CRC-32 only)."""
    records = {p.file: write_record(p.staging.file(p.file), p.tensors if tensors is None else tensors, p.metadata,
                                    sha256=sha256)}
    for small_name, data in p.small.items():
        _write_small(p.staging.file(small_name), data)
        records[small_name] = bytes_record(data)
    return records


def write_error(p: Prepared, e: BaseException) -> str:
    """The message every rank raises when this rank's `write_share` failed with `e`."""
    if isinstance(e, OSError):
        return f"rank {p.rank} could not write {p.staging.file(p.file)} ({e}); the previous checkpoint is intact"
    return describe(e, p.rank)


def complete_manifest(p: Prepared, shares: List[RankShare], records: Dict[str, FileRecord]) -> Manifest:
    """Rank 0: the manifest of every rank's share and file."""
    return fill_manifest(p.manifest, shares, records, list(p.small))


def fill_manifest(m: Manifest, shares: List[RankShare], records: Dict[str, FileRecord], small: List[str]) -> Manifest:
    """`m` (from `prepare`) with every rank's pieces and files and the small files `small`."""
    m.files = {**{s.file: records[s.file] for s in shares}, **{n: records[n] for n in small}}
    m.tensors = _tensor_table(shares)
    m.model = [dataclasses.replace(r, file=s.file) for s in shares for r in s.model]
    m.optimizer_state = [dataclasses.replace(r, file=s.file) for s in shares for r in s.optimizer_state]
    m.ranks = [RankRecord(s.file, s.rng, s.extra) for s in shares]
    return m


def commit_prepared(p: Prepared, manifest: Manifest, keep_replaced: bool = False) -> Optional[str]:
    """Rank 0: commit; None, or the error message every rank raises (the staging directory is then
    still there: `p.staging.discard()` it). `keep_replaced`: see `StagingDir.commit`."""
    try:
        check_save_destination(p.dest, p.overwrite)  # still safe to replace
        p.staging.commit(manifest, keep_replaced=keep_replaced)
    except (CheckpointError, OSError) as e:
        return str(e) if isinstance(e, CheckpointError) else (f"{p.dest}: the commit failed ({e}); the previous "
                                                              f"checkpoint is intact")
    return None


@with_whole_tensors(writeback=False)
def save(path, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
         kind: str = "sharded", extra: Optional[Dict[str, Any]] = None, overwrite: bool = False,
         files: Optional[Mapping[str, Union[bytes, str]]] = None) -> Path:
    """Write a checkpoint of `module` (and `optimizer`, `extra`) to directory `path`. COLLECTIVE:
    every rank calls it with the same `path`, `kind` and `files`. `files` (name -> bytes or str)
    are small files of the caller (a run's config), written by rank 0 into the same directory,
    listed with their hashes in the manifest and committed with it. Returns the path. An
    asynchronous save in flight (`async_save`) is waited for first."""
    wait_in_flight()
    after_commit.wait()
    p = prepare(path, module, optimizer, kind=kind, extra=extra, overwrite=overwrite, files=files)
    info: Dict[str, Any] = {"share": p.share.to_json()}
    try:
        inline = sum(t.numel() * t.element_size() for _, t in p.tensors) <= _INLINE
        info["records"] = {n: r.to_json() for n, r in write_share(p, sha256=inline).items()}
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        info["error"] = write_error(p, e)
    gathered = all_gather_json(info)
    failed = [i["error"] for i in gathered if "error" in i]
    records: Dict[str, FileRecord] = {}
    dir_fd: Optional[int] = None
    if not failed and p.rank == 0:
        records = {n: FileRecord.from_json(r, n) for i in gathered for n, r in i["records"].items()}
        try:
            dir_fd = after_commit.open_dir(p.staging.path)
        except OSError:
            dir_fd = None  # the commit will fail and say why
        error = commit_prepared(p, complete_manifest(p, [RankShare.from_json(i["share"]) for i in gathered], records),
                                keep_replaced=True)
        if error:
            failed.append(error)
    failed = broadcast_json(failed)
    if failed:
        if p.rank == 0:
            _closed(dir_fd)
            p.staging.discard()
        raise CheckpointError(failed[0])
    if p.rank == 0:
        _after_commit(p, records, dir_fd)
    return p.dest


_INLINE = 64 * 2**20  # larger: a rank file's SHA-256, a replaced checkpoint's deletion wait for after the commit


def _after_commit(p: Prepared, records: Dict[str, FileRecord], dir_fd: Optional[int]) -> None:
    """Rank 0, once committed: the work left for after the commit (`after_commit`), in a thread
    when there is some worth one, else here."""
    old = p.staging.replaced
    try:
        old_size = 0 if old is None else sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(old)
                                             if e.is_file(follow_symlinks=False))
    except OSError:
        old_size = 0
    if all(r.sha256 is not None for r in records.values()) and old_size <= _INLINE:
        if dir_fd is not None:
            os.close(dir_fd)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return
    after_commit.start(dir_fd if any(r.sha256 is None for r in records.values()) else _closed(dir_fd), old)


def _closed(fd: Optional[int]) -> None:
    if fd is not None:
        os.close(fd)
    return None
