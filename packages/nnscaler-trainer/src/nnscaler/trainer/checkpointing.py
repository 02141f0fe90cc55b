"""Checkpoints of a run through nnscaler.ckpt: layout, schedule, last / best, pruning, resume.

Layout: ``<save_dir>/<epoch:04d>-<step:04d>/`` (each an nnscaler-ckpt checkpoint directory,
committed atomically by nnscaler.ckpt), ``<save_dir>/last`` and ``<save_dir>/best`` (symlinks,
or copies with ``symlink_best_and_last: false``). The Trainer's own state (counters, data
position, LR scheduler, grad scaler, every rank's RNG states) travels in the checkpoint's
``extra`` under ``"nnscaler_trainer"`` as JSON data; ``on_save_checkpoint`` hooks may add
keys of their own to the same dict. Each checkpoint directory also holds ``train_config.yaml``,
the resolved config of the run that wrote it, committed with it.

One run per step directory: a run never writes a step that exists (it skips the steps it saved or
resumed from itself, and refuses any other), and never saves a step older than a checkpoint in
save_dir, so ``last`` never moves back. The launcher's pre-checks (`nnscaler.trainer.prechecks`)
refuse such runs before any worker starts; the checks here hold for every other way in.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from .errors import TrainerError

__all__ = ["CheckpointManager", "ckpt_backend", "TRAINER_KEY", "CONFIG_FILE", "list_checkpoints", "checkpoint_step",
           "checkpoint_state", "resolve_resume"]

TRAINER_KEY = "nnscaler_trainer"
CONFIG_FILE = "train_config.yaml"  # in every checkpoint directory: the config of the run that wrote it
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
    if resume_from in ("last", "best"):
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


class CheckpointManager:
    """Saves and finds the checkpoints of one run (see the module docstring)."""

    def __init__(self, config, config_yaml: Optional[str] = None):
        self.config = config
        self.save_dir = config.save_dir
        self.config_yaml = config_yaml
        self.rank, self.world = _rank_world()
        self._own_steps: set = set()  # steps this run saved, or resumed from: saved already

    # -- naming -------------------------------------------------------------------------------
    def path_for(self, epoch: int, step: int) -> str:
        return os.path.join(self.save_dir, f"{epoch:04d}-{step:04d}")

    def saved(self) -> List[Tuple[int, int, str]]:
        """(epoch, step, path) of every numbered checkpoint, oldest first."""
        return list_checkpoints(self.save_dir)

    def has_step(self, step: int) -> bool:
        return any(s == step for _, s, _ in self.saved())

    def resumed_at(self, step: int) -> None:
        """This run continues from a checkpoint of `step`: that step counts as saved."""
        self._own_steps.add(step)

    def check_step(self, step: int) -> bool:
        """False when this run saved (or resumed from) `step` already: nothing to write. Raises
        when save_dir holds another run's checkpoint of this step or of a later one."""
        if step in self._own_steps:
            return False
        taken = [p for _, s, p in self.saved() if s >= step]
        for name in ("last", "best"):
            link = os.path.join(self.save_dir, name)
            later = checkpoint_step(link) if os.path.exists(link) else None
            if later is not None and later >= step and not os.path.islink(link):
                taken.append(link)
        if taken:
            raise TrainerError(f"checkpoint: cannot save step {step} in {self.save_dir}: it holds "
                               f"{', '.join(os.path.basename(p) for p in taken)} from another run (a step directory "
                               f"never holds two runs, and last never moves back); resume that run "
                               f"(checkpoint.resume_from: auto), or use a new or empty checkpoint.save_dir")
        return True

    # -- saving -------------------------------------------------------------------------------
    def save(self, trainer, epoch: int, step: int, val_loss: Optional[float], extra: Dict[str, Any]) -> Optional[str]:
        """Save (collective) unless this run saved this step already; update last / best; prune.
        Refuses (TrainerError, nothing written) a step another run's checkpoint holds."""
        if not self.check_step(step):
            return None
        os.makedirs(self.save_dir, exist_ok=True)
        _barrier()  # every rank has seen the same listing before anyone writes
        path = self.path_for(epoch, step)
        files = {CONFIG_FILE: self.config_yaml} if self.config_yaml is not None else None
        ckpt_backend().save(path, trainer.model, trainer.optimizer, kind=self.config.save_type, extra=extra,
                            files=files)
        self._own_steps.add(step)
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
        """The directory to resume from (see `resolve_resume`)."""
        return resolve_resume(resume_from, self.save_dir)

    def load(self, trainer, path: str) -> Dict[str, Any]:
        """Load model and optimizer (collective, resharding as nnscaler.ckpt does); returns extra."""
        extra = ckpt_backend().load(path, trainer.model, trainer.optimizer)
        return dict(extra or {})


def _remove(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)
