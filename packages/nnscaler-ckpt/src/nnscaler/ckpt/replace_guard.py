"""What `merge`, `convert` and `save` may write to, and what their ``overwrite`` may replace.

A destination never equals its source, lies inside it or contains it. Without ``overwrite`` it
must not exist; with ``overwrite`` an existing one must be an empty directory or the output of
an earlier merge (or convert): a directory whose ``manifest.json`` says kind ``merged`` and that
holds nothing but the files that manifest lists. Anything else is refused before anything on disk
changes, so ``--overwrite`` cannot delete a run directory, a training checkpoint or user files.
`save(..., overwrite=True)` likewise replaces only an empty directory or a checkpoint (any kind)
holding nothing but the files its manifest lists.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from .commit import check_destination
from .errors import CheckpointError
from .manifest import read_manifest
from .names import MANIFEST, MANIFEST_TMP

__all__ = ["check_merge_destination", "check_save_destination"]


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _check_apart(dst: Path, sources: Sequence[Path]) -> None:
    real_dst = _real(dst)
    for src in sources:
        real_src = _real(src)
        if real_dst == real_src or real_src in real_dst.parents:
            raise CheckpointError(f"{dst} lies inside the source {src}: writing there would change the source; "
                                  f"choose a destination outside {src}")
        if real_dst in real_src.parents:
            raise CheckpointError(f"{dst} contains the source {src}: replacing it would delete the source; "
                                  f"choose a new destination directory (e.g. {dst / 'merged'})")


def _check_replaceable(dst: Path, kinds: Sequence[str], wrote: str, flag: str) -> None:
    """`dst` may be replaced: an empty directory, or one whose manifest's kind is in `kinds` and
    that holds only the files the manifest lists. `wrote` names what writes such a directory,
    `flag` the option the user passed."""
    fix = "choose a new destination, or move its contents out yourself"
    if dst.is_symlink():
        raise CheckpointError(f"{dst} is a symbolic link: {flag} replaces only a directory {wrote} "
                              f"wrote; pass that directory itself, or {fix}")
    if not dst.is_dir():
        raise CheckpointError(f"{dst} is a file, not an earlier {wrote} output: {flag} replaces only a directory "
                              f"{wrote} wrote; {fix}")
    entries = sorted(p.name for p in dst.iterdir())
    if not entries:
        return
    try:
        manifest = read_manifest(dst)
    except CheckpointError:
        manifest = None
    if manifest is None or manifest.kind not in kinds:
        shown = " or ".join(repr(k) for k in kinds)
        raise CheckpointError(f"{dst} is not the output of an earlier {wrote} (no {MANIFEST} of kind {shown}; it holds "
                              f"{', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}): {flag} replaces "
                              f"only such a directory; {fix}")
    # MANIFEST_TMP: what a manifest rewrite killed midway leaves (after_commit.py); it is ours
    foreign = [n for n in entries if n not in (MANIFEST, MANIFEST_TMP) and n not in manifest.files]
    if foreign:
        raise CheckpointError(f"{dst} holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}, which no "
                              f"{wrote} wrote: {flag} would delete it; {fix}")


def check_merge_destination(dst: Path, overwrite: bool, sources: Sequence[Path] = ()) -> None:
    """Refuse a destination `dst` of merge / convert that is not new (unless `overwrite` and an
    earlier merge output or an empty directory), or that overlaps one of `sources` (see the
    module docstring). Touches nothing on disk."""
    dst = Path(dst)
    _check_apart(dst, [Path(s) for s in sources])
    check_destination(dst, overwrite)
    if overwrite and (dst.exists() or dst.is_symlink()):
        _check_replaceable(dst, ("merged",), "merge", "--overwrite")


def check_save_destination(dst: Path, overwrite: bool) -> None:
    """Refuse a destination of `save` that exists (unless `overwrite` and it is an empty directory
    or a checkpoint holding only its own files). Touches nothing on disk."""
    dst = Path(dst)
    check_destination(dst, overwrite)
    if overwrite and (dst.exists() or dst.is_symlink()):
        _check_replaceable(dst, ("sharded", "deduped", "merged"), "checkpoint save", "overwrite=True")
