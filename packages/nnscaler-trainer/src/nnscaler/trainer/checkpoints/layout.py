"""Where a run's checkpoints live and how they are named, listed and found (no training state).

``<save_dir>/<epoch:04d>-<step:04d>/`` is one nnscaler-ckpt checkpoint directory (committed
atomically by nnscaler.ckpt, with ``train_config.yaml`` of the run that wrote it);
``<save_dir>/last`` and ``<save_dir>/best`` are symlinks to one of them, or copies with
``symlink_best_and_last: false``. The Trainer's own record travels in the checkpoint's ``extra``
under ``TRAINER_KEY``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Dict, List, Optional, Set, Tuple

from ..errors import TrainerError

__all__ = ["TRAINER_KEY", "CONFIG_FILE", "POINTERS", "ckpt_backend", "checkpoint_name", "list_checkpoints",
           "checkpoint_state", "checkpoint_step", "resolve_resume", "point", "pointed", "remove"]

TRAINER_KEY = "nnscaler_trainer"
CONFIG_FILE = "train_config.yaml"  # in every checkpoint directory: the config of the run that wrote it
POINTERS = ("last", "best")
_NAME = re.compile(r"^(\d+)-(\d+)$")

BACKEND = None  # tests may set a stand-in module with save / load / merge; None: nnscaler.ckpt


def ckpt_backend():
    """The checkpoint package (nnscaler.ckpt), checked to offer save / load / merge."""
    if BACKEND is not None:
        return BACKEND
    import nnscaler.ckpt as ckpt
    missing = [n for n in ("save", "load", "merge") if not hasattr(ckpt, n)]
    if missing:
        raise TrainerError(f"checkpoint: the installed nnscaler-ckpt has no {', '.join(missing)}() yet; set "
                           f"checkpoint.no_save: true (and no resume_from) or install a complete nnscaler-ckpt")
    return ckpt


def checkpoint_name(epoch: int, step: int) -> str:
    """The directory name of the checkpoint of `step` (in `epoch`): ``0001-0006``."""
    return f"{epoch:04d}-{step:04d}"


def list_checkpoints(save_dir: str) -> List[Tuple[int, int, str]]:
    """(epoch, step, path) of every numbered checkpoint directory in `save_dir`, oldest first."""
    if not os.path.isdir(save_dir):
        return []
    found = []
    for name in os.listdir(save_dir):
        m = _NAME.match(name)
        if m and os.path.isdir(os.path.join(save_dir, name)):
            found.append((int(m.group(1)), int(m.group(2)), os.path.join(save_dir, name)))
    return sorted(found, key=lambda t: (t[1], t[0]))


def checkpoint_state(path: str) -> Optional[Dict[str, Any]]:
    """The Trainer state (step, epoch, ...) a checkpoint's manifest records, read without loading
    anything; None when it has none (not the Trainer's, or unreadable)."""
    try:
        with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
            ranks = json.load(f).get("ranks") or []
        state = ranks[0]["extra"][TRAINER_KEY]["state"]
        return state if isinstance(state, dict) and isinstance(state.get("step"), int) else None
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


def checkpoint_step(path: str) -> Optional[int]:
    """The training step a checkpoint holds: from its name (``<epoch>-<step>``), else from the
    Trainer state its manifest records; None when neither says."""
    m = _NAME.match(os.path.basename(os.path.realpath(path)))
    if m:
        return int(m.group(2))
    state = checkpoint_state(path)
    return state["step"] if state else None


def resolve_resume(resume_from: Optional[str], save_dir: str) -> Optional[str]:
    """The checkpoint directory `resume_from` names, or None (a fresh start): ``last`` / ``best``
    (save_dir's links; None when absent: a first run starts fresh with the same command), ``auto``
    (the newest checkpoint in save_dir: what ``last`` points to, or a newer numbered one a crash
    left before ``last`` moved; None when there is none), or a path, which must exist."""
    if not resume_from:
        return None
    if resume_from in POINTERS:
        link = os.path.join(save_dir, resume_from)
        return os.path.realpath(link) if os.path.exists(link) else None
    if resume_from == "auto":
        link = os.path.join(save_dir, "last")
        found = [(s, p) for _, s, p in list_checkpoints(save_dir)]
        if os.path.exists(link):
            found.append((checkpoint_step(link), os.path.realpath(link)))
        found = [(s, p) for s, p in found if s is not None]
        return max(found, key=lambda t: t[0])[1] if found else None
    if not os.path.exists(resume_from):
        raise TrainerError(f"checkpoint.resume_from: {resume_from!r} does not exist; give a checkpoint "
                           f"directory, 'last', 'best' or 'auto'")
    return resume_from


def point(save_dir: str, name: str, target: str, symlink: bool) -> None:
    """Make ``save_dir/<name>`` (``last`` / ``best``) a symlink to `target`, or a copy of it,
    replacing the former one in one rename."""
    link = os.path.join(save_dir, name)
    tmp = os.path.join(save_dir, f".{name}.tmp")
    remove(tmp)
    if symlink:
        os.symlink(os.path.basename(target), tmp)
    else:
        shutil.copytree(target, tmp, symlinks=True)
    if os.path.isdir(link) and not os.path.islink(link):
        shutil.rmtree(link)
    os.replace(tmp, link)


def pointed(save_dir: str) -> Set[str]:
    """The real paths ``last`` and ``best`` link to (copies point to nothing)."""
    out = set()
    for name in POINTERS:
        link = os.path.join(save_dir, name)
        if os.path.islink(link):
            out.add(os.path.realpath(link))
    return out


def remove(path: str) -> None:
    """Delete a file, link or directory tree; nothing when absent."""
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)
