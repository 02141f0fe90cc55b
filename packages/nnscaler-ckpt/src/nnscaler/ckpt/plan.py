"""Planning a save: what each rank writes, as typed records, agreed by every rank before a byte is
written (as torch.distributed.checkpoint's planner comes before its storage writer).

`plan_save` is the collective part of `save` and `async_save`: every rank describes its share
(`rank_state.collect`); with ``kind="deduped"`` the ranks agree that each distinct piece is stored
by the lowest rank holding it; rank 0 checks the destination and creates the staging directory;
every rank's records reach rank 0, which completes the manifest but for the files' sizes and
hashes. The result, a `SavePlan`, is all the writer (`executor.execute`) needs besides the tensor
values, whether it runs in the caller or in the background process (it travels there as JSON).
A failure on any rank raises the same CheckpointError on every rank and leaves nothing on disk.
"""
from __future__ import annotations

import base64
import dataclasses
import datetime
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch

from .buffer_layout import Spec, spec_of
from .collectives import all_gather_json, broadcast_json, rank_and_world
from .commit import StagingDir, new_token
from .errors import CheckpointError, describe
from .module_tensors import module_plans
from .names import MANIFEST, is_staging, rank_file
from .optimizer_tensors import hyper_parameters, optimizer_class
from .rank_state import RankShare, collect, keep_only, share_of
from .records import Manifest, OptimizerInfo, RankRecord, TensorInfo
from .replace_guard import check_save_destination

__all__ = ["SavePlan", "plan_save"]


@dataclass
class SavePlan:
    """One rank's part of one save. `specs`: the tensors of its file, in order (the values come
    separately: the caller's tensors, or views of the shared buffer); `metadata`: the file's
    safetensors metadata; `sha256`: hash the file while writing it (else its size and CRC-32 only,
    the SHA-256 after the commit); `after_commit`: rank 0 leaves the SHA-256 of larger files and
    the deletion of a replaced checkpoint larger than this many bytes to a thread after the commit
    (None: everything before returning, as the background process does); `timeout`: seconds the
    ranks' background processes wait for each other. Rank 0 also holds the caller's `small` files
    and the `manifest`, complete but for its ``files``."""

    dest: str
    token: str
    rank: int
    world: int
    overwrite: bool
    file: str
    specs: List[Spec]
    metadata: Dict[str, str]
    sha256: bool = True
    after_commit: Optional[int] = None
    timeout: float = 600.0
    small: Dict[str, bytes] = field(default_factory=dict)
    manifest: Optional[Manifest] = None

    @property
    def staging(self) -> StagingDir:
        return StagingDir(self.dest, self.token, self.overwrite)

    def file_names(self) -> List[str]:
        """Rank 0: every file of the checkpoint but the manifest, in the manifest's order."""
        return [r.file for r in self.manifest.ranks] + list(self.small)

    def to_json(self) -> Dict[str, Any]:
        out = dict(self.__dict__)
        out["specs"] = [[k, d, list(s)] for k, d, s in self.specs]
        out["small"] = {n: base64.b64encode(b).decode("ascii") for n, b in self.small.items()}
        out["manifest"] = None if self.manifest is None else self.manifest.to_json()
        return out

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "SavePlan":
        data = dict(data)
        data["specs"] = [(k, d, tuple(s)) for k, d, s in data["specs"]]
        data["small"] = {n: base64.b64decode(b) for n, b in data["small"].items()}
        data["manifest"] = None if data["manifest"] is None else Manifest.from_json(data["manifest"])
        return cls(**data)


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


def _complete(m: Manifest, shares: List[RankShare]) -> Manifest:
    """`m` with every rank's tensors, pieces and rank record (the files' records come last)."""
    for share in shares:  # in each rank's local order (a fully sharded rank stores parts of some only)
        for name, info in share.tensors:
            m.tensors.setdefault(name, info)
        for rec in share.model:
            if rec.full_name not in m.tensors:
                m.tensors[rec.full_name] = TensorInfo(rec.full_shape, rec.dtype, list(rec.aliases))
    m.model = [dataclasses.replace(r, file=s.file) for s in shares for r in s.model]
    m.optimizer_state = [dataclasses.replace(r, file=s.file) for s in shares for r in s.optimizer_state]
    m.ranks = [RankRecord(s.file, s.rng, s.extra) for s in shares]
    return m


def plan_save(path, module: torch.nn.Module, optimizer=None, *, kind: str = "sharded", extra=None,
              overwrite: bool = False, files: Optional[Mapping[str, Union[bytes, str]]] = None,
              after_commit: Optional[int] = None, tag: bool = False,
              timeout: float = 600.0) -> Tuple[SavePlan, List[Tuple[str, torch.Tensor]]]:
    """COLLECTIVE: (this rank's `SavePlan`, the tensors it writes, in the plan's order). The
    staging directory exists once it returns. `after_commit`: see `SavePlan`; `tag`: the file's
    metadata names this save (``nnscaler_save``: the background processes tell its files from
    earlier ones by it). Raises the same CheckpointError on every rank when any rank fails."""
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
    name = rank_file(rank, world)
    gathered = all_gather_json({"share": share_of(st, name).to_json(), "error": error})
    if gathered[0]["error"]:
        raise CheckpointError(gathered[0]["error"])
    if rank == 0:
        manifest = _complete(manifest, [RankShare.from_json(g["share"]) for g in gathered])
    nbytes = sum(t.numel() * t.element_size() for _, t in st.tensors)
    metadata = {"format": "pt", "nnscaler": f"{kind} checkpoint, rank {rank} of {world}"}
    if tag:
        metadata["nnscaler_save"] = staging.token
    plan = SavePlan(str(dest), staging.token, rank, world, overwrite, name, [spec_of(k, t) for k, t in st.tensors],
                    metadata, sha256=after_commit is None or nbytes <= after_commit, after_commit=after_commit,
                    timeout=float(timeout), small=small if rank == 0 else {}, manifest=manifest)
    return plan, st.tensors
