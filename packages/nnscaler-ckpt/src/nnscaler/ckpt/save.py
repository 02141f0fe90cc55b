"""`save`: the collective that writes a sharded or deduped checkpoint.

Every rank describes what it holds (`rank_state.collect`); with ``kind="deduped"`` the ranks
agree (one JSON all-gather) that each distinct piece is stored by the lowest rank holding it.
Rank 0 creates the staging directory, every rank streams its safetensors file into it, hashing as
it writes (SHA-256 and chunked CRC-32, `checksums`), then rank 0 writes the manifest and commits
(`commit.StagingDir`). A failure on any rank (a full disk, a bad ``extra``) makes every rank raise
and leaves no checkpoint behind.
"""
from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

import torch

from .checksums import bytes_record
from .collectives import all_gather_json, broadcast_json, rank_and_world
from .commit import StagingDir, new_token
from .replace_guard import check_save_destination
from .errors import CheckpointError, describe
from .module_tensors import plan_identity
from .names import FORMAT, FORMAT_VERSION, MANIFEST, is_staging, rank_file
from .optimizer_tensors import hyper_parameters, optimizer_class
from .rank_state import collect, keep_only, optimizer_piece_id
from .safetensors_file import write_record

__all__ = ["save"]


def _owners(ids: List[List[str]]) -> Dict[str, int]:
    owner: Dict[str, int] = {}
    for rank, mine in enumerate(ids):
        for i in mine:
            owner.setdefault(i, rank)
    return owner


def _dedup(st, rank: int) -> None:
    gathered = all_gather_json([[r["piece"] for r in st.model], [optimizer_piece_id(r) for r in st.optimizer_state]])
    model_owner = _owners([g[0] for g in gathered])
    optim_owner = _owners([g[1] for g in gathered])
    keep_only(st, {i for i, r in model_owner.items() if r == rank}, {i for i, r in optim_owner.items() if r == rank})


def _tensor_table(ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    table: Dict[str, Any] = {}
    for info in ranks:
        for rec in info["model"]:
            table.setdefault(rec["full_name"], {"shape": rec["full_shape"], "dtype": rec["dtype"],
                                                "aliases": rec["aliases"]})
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


def save(path, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
         kind: str = "sharded", extra: Optional[Dict[str, Any]] = None, overwrite: bool = False,
         files: Optional[Mapping[str, Union[bytes, str]]] = None) -> Path:
    """Write a checkpoint of `module` (and `optimizer`, `extra`) to directory `path`. COLLECTIVE:
    every rank calls it with the same `path`, `kind` and `files`. `files` (name -> bytes or str)
    are small files of the caller (a run's config), written by rank 0 into the same directory,
    listed with their hashes in the manifest and committed with it. Returns the path."""
    if kind not in ("sharded", "deduped"):
        raise CheckpointError(f"save(kind={kind!r}): kind must be 'sharded' or 'deduped' (merge a checkpoint "
                              f"offline with nnscaler.ckpt.merge)")
    rank, world = rank_and_world()
    dest = Path(path).absolute()
    error: Optional[str] = None
    st = None
    small: Dict[str, bytes] = {}
    small_records: Dict[str, Any] = {}
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
    if rank == 0:
        try:
            check_save_destination(dest, overwrite)
            staging.create()
        except (CheckpointError, OSError) as e:
            error = str(e) if isinstance(e, CheckpointError) else f"{dest}: cannot create the checkpoint ({e})"
    error = broadcast_json(error)
    if error:
        raise CheckpointError(error)
    name = rank_file(rank, world)
    info: Dict[str, Any] = {"file": name}
    try:
        record = write_record(staging.file(name), st.tensors,
                              {"format": "pt", "nnscaler": f"{kind} checkpoint, rank {rank} of {world}"})
        info.update(record=record, model=st.model, optimizer_state=st.optimizer_state, rng=st.rng,
                    extra=st.extra)
        if rank == 0:
            for small_name, data in small.items():
                _write_small(staging.file(small_name), data)
            small_records = {n: bytes_record(d) for n, d in small.items()}
    except OSError as e:
        info["error"] = f"rank {rank} could not write {staging.file(name)} ({e}); the previous checkpoint is intact"
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        info["error"] = describe(e, rank)
    ranks = all_gather_json(info)
    failed = [i["error"] for i in ranks if "error" in i]
    if not failed and rank == 0:
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "kind": kind, "world_size": world,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "plan": plan_identity(module),
            "files": {**{i["file"]: i["record"] for i in ranks}, **small_records},
            "tensors": _tensor_table(ranks),
            "optimizer": None if optimizer is None else {"class": optimizer_class(optimizer),
                                                          "param_groups": hyper_parameters(optimizer)},
            "model": [{**rec, "file": i["file"]} for i in ranks for rec in i["model"]],
            "optimizer_state": [{**rec, "file": i["file"]} for i in ranks for rec in i["optimizer_state"]],
            "ranks": [{"file": i["file"], "rng": i["rng"], "extra": i["extra"]} for i in ranks],
        }
        try:
            check_save_destination(dest, overwrite)  # still safe to replace
            staging.commit(manifest)
        except (CheckpointError, OSError) as e:
            failed.append(str(e) if isinstance(e, CheckpointError) else f"{dest}: the commit failed ({e}); the "
                                                                         f"previous checkpoint is intact")
    failed = broadcast_json(failed)
    if failed:
        if rank == 0:
            staging.discard()
        raise CheckpointError(failed[0])
    return dest
