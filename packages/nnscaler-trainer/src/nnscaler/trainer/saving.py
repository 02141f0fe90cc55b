"""Saving a checkpoint of a running Trainer: validation first, the Trainer's state in ``extra``,
the ``on_save_checkpoint`` hooks, then nnscaler.ckpt through the CheckpointManager."""
from __future__ import annotations

from typing import Any, Dict, Optional

from nnscaler.ckpt import encode_extra

from .checkpointing import TRAINER_KEY

__all__ = ["save_checkpoint", "trainer_extra"]


def save_checkpoint(trainer, val_loss: Optional[float] = None) -> Optional[str]:
    """See `Trainer.save_checkpoint`."""
    if not trainer.checkpoints.check_step(trainer.state.step):
        return None  # saved (or resumed from) by this run: a finished run re-run rewrites nothing
    if val_loss is None:
        val_loss = trainer.validate()
    if val_loss is None:
        val_loss = trainer.state.last_train_loss  # no validation data: the train loss ranks checkpoints
    extra = {TRAINER_KEY: trainer_extra(trainer, val_loss)}
    trainer.hooks.on_save_checkpoint(trainer, extra)
    path = trainer.checkpoints.save(trainer, trainer._current_epoch(), trainer.state.step, val_loss, extra)
    best = trainer.state.best_val_loss
    if val_loss is not None and (best is None or val_loss <= best):
        trainer.state.best_val_loss = val_loss
    return path


def trainer_extra(trainer, val_loss: Optional[float]) -> Dict[str, Any]:
    """Counters, data position, LR scheduler and grad scaler, as JSON with tensors (nnscaler.ckpt
    saves each rank's RNG states itself)."""
    state = trainer.state.to_dict()
    best = state["best_val_loss"]
    if val_loss is not None and (best is None or val_loss <= best):
        state["best_val_loss"] = val_loss
    state["last_val_loss"] = val_loss
    scheduler = trainer.lr_scheduler
    return {"state": state, "world_size": trainer.world_size,
            "lr_scheduler": encode_extra(scheduler.state_dict()) if scheduler is not None else None,
            "precision": encode_extra(trainer.precision.state_dict())}
