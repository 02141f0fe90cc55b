"""Checkpoints of a run through nnscaler.ckpt: layout, schedule, last / best, pruning, resume.

Layout: ``<save_dir>/<epoch:04d>-<step:04d>/`` (each an nnscaler-ckpt checkpoint directory,
committed atomically by nnscaler.ckpt), ``<save_dir>/last`` and ``<save_dir>/best`` (symlinks,
or copies with ``symlink_best_and_last: false``). The Trainer's own state (counters, data
position, LR scheduler, grad scaler, every rank's RNG states) travels in the checkpoint's
``extra`` under ``"nnscaler_trainer"`` as JSON data; ``on_save_checkpoint`` hooks may add
keys of their own to the same dict.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from .errors import TrainerError

__all__ = ["CheckpointManager", "ckpt_backend", "TRAINER_KEY"]

TRAINER_KEY = "nnscaler_trainer"
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


def _rank_world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class CheckpointManager:
    """Saves and finds the checkpoints of one run (see the module docstring)."""

    def __init__(self, config):
        self.config = config
        self.save_dir = config.save_dir
        self.rank, self.world = _rank_world()

    # -- naming -------------------------------------------------------------------------------
    def path_for(self, epoch: int, step: int) -> str:
        return os.path.join(self.save_dir, f"{epoch:04d}-{step:04d}")

    def saved(self) -> List[Tuple[int, int, str]]:
        """(epoch, step, path) of every numbered checkpoint, oldest first."""
        if not os.path.isdir(self.save_dir):
            return []
        found = []
        for name in os.listdir(self.save_dir):
            m = _NAME.match(name)
            if m and os.path.isdir(os.path.join(self.save_dir, name)):
                found.append((int(m.group(1)), int(m.group(2)), os.path.join(self.save_dir, name)))
        return sorted(found)

    def has_step(self, step: int) -> bool:
        return any(s == step for _, s, _ in self.saved())

    # -- saving -------------------------------------------------------------------------------
    def save(self, trainer, epoch: int, step: int, val_loss: Optional[float], extra: Dict[str, Any]) -> Optional[str]:
        """Save (collective) unless a checkpoint of this step exists; update last / best; prune."""
        if self.has_step(step):
            return None
        _barrier()  # every rank has seen the same listing before anyone writes
        path = self.path_for(epoch, step)
        ckpt_backend().save(path, trainer.model, trainer.optimizer, kind=self.config.save_type, extra=extra)
        if self.rank == 0:
            if self.config.save_last:
                self._point("last", path)
            best = trainer.state.best_val_loss
            if self.config.save_best and val_loss is not None and (best is None or val_loss <= best):
                self._point("best", path)
            self._prune()
        _barrier()
        return path

    def _point(self, name: str, target: str) -> None:
        link = os.path.join(self.save_dir, name)
        tmp = os.path.join(self.save_dir, f".{name}.tmp")
        _remove(tmp)
        if self.config.symlink_best_and_last:
            os.symlink(os.path.basename(target), tmp)
        else:
            shutil.copytree(target, tmp, symlinks=True)
        if os.path.isdir(link) and not os.path.islink(link):
            shutil.rmtree(link)
        os.replace(tmp, link)

    def _pointed(self) -> set:
        out = set()
        for name in ("last", "best"):
            link = os.path.join(self.save_dir, name)
            if os.path.islink(link):
                out.add(os.path.realpath(link))
        return out

    def _prune(self) -> None:
        keep = self.config.keep_last_n_checkpoints
        if not keep:
            return
        saved = self.saved()
        protected = self._pointed()
        for _, _, path in saved[:-keep]:
            if os.path.realpath(path) not in protected:
                shutil.rmtree(path, ignore_errors=True)

    # -- resuming -----------------------------------------------------------------------------
    def resolve(self, resume_from: Optional[str]) -> Optional[str]:
        """The directory to resume from: ``last`` / ``best`` under save_dir (None when absent,
        as the seed says), or the given path (which must exist)."""
        if not resume_from:
            return None
        if resume_from in ("last", "best"):
            path = os.path.join(self.save_dir, resume_from)
            return os.path.realpath(path) if os.path.exists(path) else None
        if not os.path.exists(resume_from):
            raise TrainerError(f"checkpoint.resume_from: {resume_from!r} does not exist; give a checkpoint "
                               f"directory, 'last' or 'best'")
        return resume_from

    def load(self, trainer, path: str) -> Dict[str, Any]:
        """Load model and optimizer (collective, resharding as nnscaler.ckpt does); returns extra."""
        extra = ckpt_backend().load(path, trainer.model, trainer.optimizer)
        return dict(extra or {})


def _remove(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)
