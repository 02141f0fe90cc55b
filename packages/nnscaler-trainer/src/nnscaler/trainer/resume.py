"""Resuming a run from ``checkpoint.resume_from``: weights and optimizer through nnscaler.ckpt,
then the Trainer's own state (counters, data position, LR scheduler, grad scaler, RNG)."""
from __future__ import annotations

import warnings

from nnscaler.ckpt import decode_extra, rng_snapshot

from .checkpointing import TRAINER_KEY, ckpt_backend
from .config.values import build_args
from .errors import TrainerConfigWarning
from .state import TrainState

__all__ = ["resume"]


def resume(trainer) -> bool:
    """Load the checkpoint ``resume_from`` names, if any; True when something was loaded."""
    path = trainer.checkpoints.resolve(trainer.train_args.checkpoint.resume_from)
    if path is None:
        return False
    extra = trainer.checkpoints.load(trainer, path)
    ours = extra.get(TRAINER_KEY)
    if isinstance(ours, list):  # a merged checkpoint keeps every rank's extra
        ours = ours[0] if ours else None
    changed = None
    if ours:
        trainer.state = TrainState.from_dict(ours["state"])
        if trainer.lr_scheduler is not None and ours.get("lr_scheduler") is not None:
            trainer.lr_scheduler.load_state_dict(decode_extra(ours["lr_scheduler"]))
            changed = _config_wins(trainer)
        if ours.get("precision"):
            trainer.precision.load_state_dict(decode_extra(ours["precision"]))
        saved = ckpt_backend().inspect(path)
        if saved["world_size"] == trainer.world_size and trainer.rank in saved["rng_ranks"]:
            trainer._pending_rng = rng_snapshot(trainer.model)  # nnscaler.ckpt.load restored them; again at start
        else:
            warnings.warn(f"checkpoint.resume_from: {path} was saved by {ours.get('world_size')} processes, this run "
                          f"has {trainer.world_size}: random states start afresh (the run is not bitwise the "
                          f"continuation)", TrainerConfigWarning)
    trainer.checkpoints.resumed_at(trainer.state.step)
    trainer.hooks.on_load_checkpoint(trainer, extra)
    if trainer.rank == 0:
        trainer.console.line(f"resumed from {path} at epoch {trainer.state.epoch}, step {trainer.state.step}")
        if changed:
            trainer.console.line(f"lr_scheduler: {changed} (this run's config; the checkpoint had the former)")
    return True


def _config_wins(trainer) -> str:
    """The scheduler arguments this run's config gives replace the checkpoint's values of the same
    name (``T_max: ${max_train_steps}`` stretches a cosine schedule when a resumed run trains on);
    the counters (``last_epoch``, the current LR) stay the checkpoint's."""
    scheduler = trainer.lr_scheduler
    state = scheduler.state_dict()
    changed = []
    for name, value in build_args(trainer.train_args.lr_scheduler.args, "lr_scheduler.args").items():
        if isinstance(value, (int, float, str)) and name in state and hasattr(scheduler, name) and state[name] != value:
            changed.append(f"{name} {state[name]} -> {value}")
            setattr(scheduler, name, value)
    return ", ".join(changed)
