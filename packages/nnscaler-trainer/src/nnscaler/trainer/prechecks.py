"""What a run's config says about the disk, checked before any worker starts and before anything is
written: `nnscaler train` runs `check_paths` in the launcher, and `Trainer.run` on every rank.

- ``checkpoint.save_dir`` and ``gen_savedir`` are (or can be created as) writable directories;
- ``checkpoint.resume_from`` naming a path: it is a checkpoint directory (nnscaler.ckpt's manifest);
- a run that would start fresh (``resume_from`` unset, or ``last`` / ``best`` / ``auto`` finding
  nothing) into a save_dir that holds checkpoints is refused: one save_dir holds one run;
- a run that resumes from step S into a save_dir holding a checkpoint of a later step is refused
  (its steps would land beside that run's, and ``last`` would move back);
- a resume whose global batch size cannot start where the checkpoint stopped in its epoch is
  refused (`data_position`: the samples read carry over, the steps are counted in this run's size).

Every refusal is a `TrainerConfigError` naming the key, the directory and the choices.
"""
from __future__ import annotations

import os
from typing import List, Optional

from .checkpoints import checkpoint_state, checkpoint_step, list_checkpoints, resolve_resume
from .data_position import resumed_step_in_epoch
from .errors import TrainerConfigError

__all__ = ["check_paths", "nothing_to_train"]


def check_paths(args) -> None:
    """Raise TrainerConfigError for the first disk rule `args` (TrainerArgs) breaks (see above)."""
    _writable_dir("gen_savedir", args.gen_savedir)
    if args.run_mode != "run":
        return
    ckpt = args.checkpoint
    if not ckpt.no_save:
        _writable_dir("checkpoint.save_dir", ckpt.save_dir)
    if ckpt.resume_from not in (None, "", "last", "best", "auto") and not os.path.exists(ckpt.resume_from):
        raise TrainerConfigError("checkpoint.resume_from", f"{ckpt.resume_from!r} does not exist; give a checkpoint "
                                                           f"directory, 'last', 'best' or 'auto'")
    path = resolve_resume(ckpt.resume_from, ckpt.save_dir)
    if path is not None:
        _is_checkpoint(path)
        _data_position_fits(args, path)
    if ckpt.no_save:
        return
    held = _held(ckpt.save_dir)
    if not held:
        return
    names = _names(held)
    if path is None:
        how = "" if not ckpt.resume_from else f" (resume_from {ckpt.resume_from!r} finds no checkpoint there)"
        raise TrainerConfigError("checkpoint.save_dir", f"{ckpt.save_dir} already holds checkpoints ({names}) and "
                                 f"this run would start afresh{how}: resume them with --checkpoint.resume_from auto "
                                 f"(or last), or give a new or empty save_dir (--checkpoint.save_dir DIR)")
    step = checkpoint_step(path)
    later = [(s, p) for s, p in held if step is not None and s is not None and s > step]
    if later:
        raise TrainerConfigError("checkpoint.resume_from", f"{ckpt.resume_from!r} is step {step} but "
                                 f"{ckpt.save_dir} holds later checkpoints ({_names(later)}): "
                                 f"resume from the newest with --checkpoint.resume_from auto (or last), or continue "
                                 f"from step {step} into a new save_dir (--checkpoint.save_dir DIR)")


def nothing_to_train(args) -> Optional[str]:
    """A one-line note when the checkpoint ``resume_from`` resolves to has reached the end this
    config sets (max_train_steps / max_epochs): the run would train and write nothing; else None.
    Call after `check_paths`."""
    if args.run_mode != "run":
        return None
    path = resolve_resume(args.checkpoint.resume_from, args.checkpoint.save_dir)
    state = checkpoint_state(path) if path is not None else None
    if state is None:
        return None
    step, epoch = state["step"], state.get("epoch", 0)
    if args.max_train_steps is not None and step >= args.max_train_steps:
        end = f"max_train_steps {args.max_train_steps}"
    elif args.max_epochs is not None and isinstance(epoch, int) and epoch >= args.max_epochs:
        end = f"max_epochs {args.max_epochs}"
    else:
        return None
    return (f"nothing to train: {path} is at step {step} and this run ends at {end}; nothing was written "
            f"(raise --max_train_steps or --max_epochs to train on)")


def _data_position_fits(args, path: str) -> None:
    """The resumed run's global batch size can continue from where the checkpoint stopped in its
    epoch (`data_position`; raises TrainerConfigError naming the sizes that can)."""
    state = checkpoint_state(path)
    if state is not None:
        resumed_step_in_epoch(state.get("samples_in_epoch"), state.get("idx_in_epoch", 0),
                              args.resolved_global_batch_size, where=path)


def _writable_dir(key: str, path: str) -> None:
    """`path` is a writable directory, or can be created as one (its nearest existing ancestor is)."""
    probe = os.path.abspath(path)
    if os.path.exists(probe) and not os.path.isdir(probe):
        raise TrainerConfigError(key, f"{path} is a file, not a directory: give a directory path")
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise TrainerConfigError(key, f"{path} cannot be created: {probe} is a file; give a path under a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise TrainerConfigError(key, f"{path} is not writable ({probe} denies writing): give a directory you can "
                                      f"write to")


def _is_checkpoint(path: str) -> None:
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "manifest.json")):
        raise TrainerConfigError("checkpoint.resume_from", f"{path} is not a checkpoint directory (no "
                                 f"manifest.json): give a directory a run saved (e.g. save_dir/0000-0060), a merged "
                                 f"one, 'last', 'best' or 'auto'")


def _held(save_dir: str) -> List[tuple]:
    """(step, path) of every checkpoint in save_dir: the numbered ones and last / best copies."""
    held = [(s, p) for _, s, p in list_checkpoints(save_dir)]
    for name in ("last", "best"):
        link = os.path.join(save_dir, name)
        if os.path.isdir(link) and not os.path.islink(link):
            held.append((checkpoint_step(link), link))
    return held


def _names(held) -> str:
    names = [os.path.basename(p) for _, p in held]
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
