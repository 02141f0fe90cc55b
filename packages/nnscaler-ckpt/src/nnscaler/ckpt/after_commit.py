"""What a synchronous `save` leaves for after its commit, done by one thread of rank 0: the
SHA-256 of its large rank files and the deletion of the checkpoint it replaced.

Hashing 2 GiB at ~2 GB/s per core would double the time of a save, so `save` commits a large
rank file with its size and chunked CRC-32 only (no ``sha256`` in its manifest record). Rank 0
then hashes those files (reading them back, from the page cache) and rewrites ``manifest.json``
with their SHA-256, atomically (temporary file, fsync, rename, directory fsync), through a
descriptor of the checkpoint directory opened before the commit (a later rename cannot send the
write elsewhere), and only if the manifest is still the one committed. A kill before that leaves
the committed manifest: the checkpoint is complete, and `verify` / `load` / `merge` check those
files with their CRC-32. Freeing the blocks of a large replaced checkpoint takes a while too
(~0.3 s for 2 GiB), so it is deleted by the same thread. The next `save` or `async_save` of
this process waits for the thread, and so does the interpreter at exit (not a daemon); the thread
is the in-flight owner's (`inflight.OWNER`), like everything else a save leaves running.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from pathlib import Path
from typing import Optional

from .errors import CheckpointError
from .inflight import OWNER
from .names import MANIFEST, MANIFEST_TMP
from .records import Manifest

__all__ = ["open_dir", "start", "wait"]

_BLOCK = 16 * 2**20


def open_dir(path) -> int:
    """A descriptor of directory `path` (it follows the directory through renames)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def start(dir_fd: Optional[int], replaced: Optional[Path]) -> None:
    """Rank 0, after a commit: fill in the missing SHA-256 of the manifest in directory `dir_fd`
    (closed by the thread; None: nothing to hash), then delete `replaced` (or None), in the
    in-flight owner's after-commit thread."""
    OWNER.wait_after_commit()
    committed = _read(dir_fd, MANIFEST) if dir_fd is not None else None
    OWNER.run_after_commit(_run, dir_fd, committed, replaced)


def wait() -> None:
    """Wait until the work after the last commit of this process is done."""
    OWNER.wait_after_commit()


def _read(dir_fd: int, name: str) -> bytes:
    with open(name, "rb", opener=lambda p, f: os.open(p, f, dir_fd=dir_fd)) as f:
        return f.read()


def _sha256(dir_fd: int, name: str) -> str:
    h = hashlib.sha256()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open(name, "rb", buffering=0, opener=lambda p, f: os.open(p, f, dir_fd=dir_fd)) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _with_sha256(dir_fd: int, committed: bytes) -> Optional[bytes]:
    """The bytes of the committed manifest with the SHA-256 of every file it records without one
    (None: there is none), through the typed records."""
    manifest = Manifest.loads(committed, MANIFEST)
    missing = [n for n, r in manifest.files.items() if r.sha256 is None]
    if not missing:
        return None
    for name in missing:
        manifest.files[name] = dataclasses.replace(manifest.files[name], sha256=_sha256(dir_fd, name))
    return manifest.dumps()


def _replace_manifest(dir_fd: int, committed: bytes, new: bytes) -> None:
    if _read(dir_fd, MANIFEST) != committed:
        return  # replaced meanwhile (by hand): keep it
    fd = os.open(MANIFEST_TMP, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dir_fd)
    try:
        view = memoryview(new)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(MANIFEST_TMP, MANIFEST, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


def _run(dir_fd: Optional[int], committed: Optional[bytes], replaced: Optional[Path]) -> None:
    try:
        if dir_fd is not None:
            new = _with_sha256(dir_fd, committed)
            if new is not None:
                _replace_manifest(dir_fd, committed, new)
    except (OSError, CheckpointError):
        pass  # the committed manifest stays: its CRC-32 checks the files
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
