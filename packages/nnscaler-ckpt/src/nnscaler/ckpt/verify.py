"""`verify(path)`: every file of a checkpoint is there, with the size and SHA-256 the manifest
records (the CRC-32 of every chunk for a file recorded without a SHA-256: a synchronous save's
rank files), and nothing is left over that the manifest does not list. `check_file` and
`read_checked` are the same checks at a chosen level (`checksums`) for `load` and `merge`."""
from __future__ import annotations

import hashlib
import mmap
from pathlib import Path
from typing import Iterable, Optional

from .checksums import Level, crc32_chunks, file_crc32_chunks, verify_level
from .errors import CheckpointError
from .manifest import read_manifest, sha256_file
from .records import FileRecord, Manifest

__all__ = ["verify", "check_file", "read_checked", "crc_uses", "crc_mismatch"]


def _mismatch(path: Path) -> CheckpointError:
    return CheckpointError(f"{path} does not match its SHA-256 in the manifest (corrupted): copy the file back "
                           f"or use an earlier checkpoint")


def _check_size(path: Path, record: FileRecord) -> None:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (the manifest lists it): the checkpoint is incomplete; copy the "
                              f"file back or use an earlier checkpoint")
    size = path.stat().st_size
    if size != record.size:
        raise CheckpointError(f"{path} has {size} bytes, the manifest records {record.size} (truncated or "
                              f"replaced): copy the file back or use an earlier checkpoint")


def _crc_mismatch(path: Path) -> CheckpointError:
    return CheckpointError(f"{path} does not match its CRC-32 in the manifest (corrupted): copy the file back "
                           f"or use an earlier checkpoint")


def crc_uses(record: FileRecord, level: str) -> bool:
    """Whether a file of `record` is checked at `level` by its chunked CRC-32 (see `_check_content`)."""
    crc = record.crc32
    return level != "size" and crc is not None and crc.chunk > 0 and record.size > 0 and \
        (record.sha256 is None or level == "fast")


def crc_mismatch(path: Path, record: FileRecord, sha=None) -> CheckpointError:
    """The error for file `path` whose chunks do not match their CRC-32: confirmed with the
    SHA-256 when the record has one (`sha`: a function giving the file's, default: read it), so
    a corrupted file gets the same error at every level, and a manifest whose CRC-32 is wrong is
    named as corrupt."""
    if record.sha256 is None:
        return _crc_mismatch(path)
    if (sha or (lambda: sha256_file(path)))() == record.sha256:  # confirm: is it the file or the manifest?
        return CheckpointError(f"{path} matches its SHA-256 but not its CRC-32 in the manifest: the manifest is "
                               f"corrupt; check it with `nnscaler ckpt verify` or use an earlier checkpoint")
    return _mismatch(path)


def _check_content(path: Path, data, record: FileRecord, level: str) -> None:
    """Check file `path` (its bytes `data`, a buffer, or None: read the file) at `level`. A record
    without a SHA-256 is checked with its CRC-32 at both the "fast" and the "sha256" level."""
    crc = record.crc32
    if level == "size":
        return
    if record.sha256 is None:
        got = [] if not record.size else (crc32_chunks(data, crc.chunk) if data is not None
                                          else file_crc32_chunks(path, record.size, crc.chunk))
        if got != list(crc.values):
            raise _crc_mismatch(path)
        return
    sha = (lambda: hashlib.sha256(data).hexdigest()) if data is not None else (lambda: sha256_file(path))
    if crc_uses(record, level):
        got = crc32_chunks(data, crc.chunk) if data is not None else file_crc32_chunks(path, record.size, crc.chunk)
        if got != list(crc.values):
            raise crc_mismatch(path, record, sha)
        return
    if sha() != record.sha256:
        raise _mismatch(path)


def check_file(root: Path, name: str, record: FileRecord, hash_: Level = True) -> None:
    """Raise CheckpointError when file `name` is missing, has another size or, at level `hash_`
    (True: SHA-256, False: size only, or a `checksums` level), other contents."""
    path = root / name
    _check_size(path, record)
    _check_content(path, None, record, verify_level(hash_))


def read_checked(root: Path, name: str, record: FileRecord, hash_: Level = True):
    """The whole file as a uint8 tensor (a private memory map: no copy), checked at level `hash_`
    (as `check_file`) on the mapped bytes. Raises like `check_file`."""
    import torch
    path = root / name
    _check_size(path, record)
    if record.size == 0:
        return torch.empty(0, dtype=torch.uint8)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    view = memoryview(mapped)
    try:
        _check_content(path, view, record, verify_level(hash_))
    finally:
        view.release()
    return torch.frombuffer(mapped, dtype=torch.uint8)


def verify(path, files: Optional[Iterable[str]] = None) -> Manifest:
    """Check the manifest and the size and SHA-256 (CRC-32 where no SHA-256 is recorded) of every
    file (or only `files`); returns the
    `Manifest` (``m.kind``, ``m.files``; ``m["kind"]`` reads the JSON field). Raises
    CheckpointError naming the first bad file and the fix."""
    root = Path(path)
    manifest = read_manifest(root)
    records = manifest.files
    for name in (records if files is None else files):
        if name not in records:
            raise CheckpointError(f"{root / name} is not listed in {root / 'manifest.json'}")
        check_file(root, name, records[name])
    return manifest
