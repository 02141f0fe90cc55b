"""Writing a file so that readers see the old content or the whole new one, never a part.

The data goes to ``<name>.tmp`` beside the target, is flushed and fsynced, then renamed over the
target (``os.replace``, atomic on POSIX and Windows), and the directory is fsynced so the rename
survives a power cut. Used for generated code, manifests, plan reports, received files and
checkpoints: one implementation for every package. It lives in ir, which is not the IR's
concern, because ir is the one part all its users (codegen, policies, the runtime, ckpt) may import
(docs/architecture.md, "The IR").
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

__all__ = ["TMP_SUFFIX", "AtomicFile", "atomic_write", "exchange_paths", "fsync_dir"]

TMP_SUFFIX = ".tmp"


def fsync_dir(directory: Union[str, os.PathLike]) -> None:
    """fsync a directory (its entries: a rename, a new file); a no-op where the OS cannot."""
    try:
        fd = os.open(str(directory), os.O_RDONLY)
    except OSError:  # Windows cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicFile:
    """A file written in pieces then committed: ``with AtomicFile(path) as f: f.write(b)``
    commits on success and discards on an exception; or call `write`, `commit`, `discard`."""

    def __init__(self, path: Union[str, os.PathLike], fsync: bool = True):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + TMP_SUFFIX)
        self.fsync = fsync
        self._file: Optional[object] = open(self.tmp, "wb")

    def write(self, data: Union[bytes, bytearray, memoryview]) -> None:
        self._file.write(data)

    def commit(self) -> Path:
        """Make the written bytes the content of `path`."""
        f, self._file = self._file, None
        try:
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        finally:
            f.close()
        os.replace(self.tmp, self.path)
        if self.fsync:
            fsync_dir(self.path.parent)
        return self.path

    def discard(self) -> None:
        """Drop what was written; `path` keeps its old content (or stays absent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def atomic_write(path: Union[str, os.PathLike], data: Union[bytes, str], *, fsync: bool = True) -> Path:
    """Write `data` (str as UTF-8) to `path` atomically; returns the path."""
    with AtomicFile(path, fsync=fsync) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return f.path


def exchange_paths(a: Union[str, os.PathLike], b: Union[str, os.PathLike]) -> bool:
    """Atomically exchange two existing paths (files or directories) with Linux's renameat2
    RENAME_EXCHANGE: readers see one or the other, never neither. False where the OS or the
    file system cannot (the caller falls back to two renames)."""
    import ctypes
    import sys
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL / ENOSYS / EOPNOTSUPP: the file system cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))
