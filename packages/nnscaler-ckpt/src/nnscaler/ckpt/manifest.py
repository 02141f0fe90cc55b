"""``manifest.json``: what makes a checkpoint directory valid, and reading it back (the disk
boundary of the typed records, `records.Manifest`; `commit.StagingDir.commit` writes it).

Fields: ``format`` ("nnscaler-checkpoint"), ``format_version``, ``kind`` (sharded, deduped,
merged), ``world_size``, ``plan`` (per parallelized module: path, graph fingerprint, compute
config), ``files`` (name -> size, SHA-256 and chunked CRC-32 of every other file, see
`checksums`), ``model`` and
``optimizer_state`` (one record per stored piece: its file and key and its place in the full
tensor), ``tensors`` (full name -> shape and dtype), ``optimizer`` (class, hyper-parameters),
``ranks`` (per saving rank: RNG states and the caller's ``extra``). No pickle anywhere. The bytes
are read and written only through `records.Manifest` (``loads`` / ``dumps``).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from .commit import abandoned_siblings
from .errors import CheckpointError
from .names import MANIFEST, is_staging
from .records import REQUIRED, Manifest

__all__ = ["read_manifest", "sha256_file", "REQUIRED", "Manifest"]

_CHUNK = 8 * 2**20


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                return h.hexdigest()
            h.update(block)


def read_manifest(path) -> Manifest:
    """The manifest of checkpoint directory `path`, checked for shape and version (not the files:
    see `verify`), as a `Manifest`. Every refusal names the path and what to do."""
    path = Path(path)
    if is_staging(path.name):
        raise CheckpointError(f"{path} is a checkpoint still being written (or abandoned by a crashed save): wait "
                              f"for the save to finish, or delete it and use the previous checkpoint")
    if not path.exists():
        left = abandoned_siblings(path)
        whole = [p for p in left if (p / MANIFEST).is_file()]
        if whole:  # a replacement was cut between its renames (no RENAME_EXCHANGE here): nothing was lost
            hint = (f"; a replacement of it was interrupted and {whole[0].name} beside it holds a complete checkpoint:"
                    f" rename it to {path.name}")
        else:
            hint = f"; a save into it did not finish ({left[0].name} is its partial copy, delete it)" if left else ""
        raise CheckpointError(f"{path} does not exist{hint}: pass the directory of a saved checkpoint")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint directory: pass the directory save() wrote "
                              f"(to import a torch or safetensors file, use `nnscaler ckpt convert`)")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{mpath} is missing: {path} is not a complete checkpoint (a save did not finish, "
                              f"or it is not a checkpoint); use an earlier checkpoint")
    return Manifest.loads(mpath.read_bytes(), mpath)
