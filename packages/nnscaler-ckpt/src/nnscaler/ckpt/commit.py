"""The atomic commit of a checkpoint directory: the one way this package writes a checkpoint.

Files go into a temporary sibling ``.<name>.writing-<token>/``, each fsynced as it is closed;
`StagingDir.commit` then writes ``manifest.json`` last (through ``nnscaler.ir.atomic_write``:
temp file, fsync, rename), fsyncs the directory, renames it to ``<name>`` and fsyncs the parent.
A crash at any point leaves either no ``<name>`` (or the previous one, untouched) plus a
``.writing-`` directory that nothing takes for a checkpoint, or the complete new checkpoint.
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from nnscaler.ir import atomic_write, exchange_paths, fsync_dir

from .errors import CheckpointError
from .names import MANIFEST, STAGING_MARK, is_staging, staging_prefix
from .records import Manifest

__all__ = ["StagingDir", "check_destination", "new_token"]


def new_token() -> str:
    return uuid.uuid4().hex[:16]


def check_destination(dest: Path, overwrite: bool) -> None:
    """Refuse a destination that exists (unless `overwrite`), or that is a staging directory."""
    if is_staging(dest.name):
        raise CheckpointError(f"{dest}: this name is reserved for checkpoints being written; choose another path")
    if not dest.parent.is_dir():
        raise CheckpointError(f"{dest.parent}: the parent directory does not exist; create it first")
    if (dest.exists() or dest.is_symlink()) and not overwrite:
        raise CheckpointError(f"{dest} already exists: choose a new path, or pass overwrite=True "
                              f"(--overwrite) to replace it")


class StagingDir:
    """The temporary sibling a checkpoint at `dest` is written into (see the module docstring)."""

    def __init__(self, dest, token: str, overwrite: bool = False):
        self.dest = Path(dest)
        self.overwrite = overwrite
        self.token = token
        self.path = self.dest.parent / f"{staging_prefix(self.dest.name)}{token}"
        self.replaced: Optional[Path] = None  # see commit(keep_replaced=True)

    def create(self) -> "StagingDir":
        check_destination(self.dest, self.overwrite)
        self.path.mkdir()
        return self

    def file(self, name: str) -> Path:
        return self.path / name

    def commit(self, manifest: Union[Manifest, Mapping[str, Any]], *, keep_replaced: bool = False) -> Path:
        """Write the manifest (a `Manifest`, or its JSON) last, then move the directory into place.
        The checkpoint it replaces (``overwrite``) is deleted, or with `keep_replaced` left under
        a staging name in `replaced` for the caller to delete (`save` spreads it over its ranks)."""
        typed = manifest if isinstance(manifest, Manifest) else Manifest.from_json(dict(manifest), self.path / MANIFEST)
        atomic_write(self.path / MANIFEST, typed.dumps())
        fsync_dir(self.path)
        old: Optional[Path] = None
        if self.dest.exists() or self.dest.is_symlink():
            if not self.overwrite:
                raise CheckpointError(f"{self.dest} appeared while the checkpoint was written; it is kept and "
                                      f"the new one left in {self.path}")
            if self.dest.is_dir() and not self.dest.is_symlink() and exchange_paths(self.path, self.dest):
                old = self.path  # now holds the previous checkpoint
            else:  # the previous one stays whole under a staging name until the new one is in
                old = self.dest.parent / f"{staging_prefix(self.dest.name)}{new_token()}"
                os.rename(self.dest, old)
                os.rename(self.path, self.dest)
        else:
            os.rename(self.path, self.dest)
        fsync_dir(self.dest.parent)
        if old is not None and keep_replaced and old.is_dir() and not old.is_symlink():
            self.replaced = old
        elif old is not None:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() and not old.is_symlink() else old.unlink()
        return self.dest

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def abandoned_siblings(dest: Path) -> list:
    """Staging directories left beside `dest` (a crash during a save)."""
    prefix = staging_prefix(dest.name)
    if not dest.parent.is_dir():
        return []
    return sorted(p for p in dest.parent.iterdir() if p.name.startswith(prefix) and STAGING_MARK in p.name)

