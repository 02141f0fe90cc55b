"""A run's checkpoints: `layout` (names, listing, ``resume_from``), `manager` (CheckpointManager:
when, what, last / best, pruning, resume). See docs/trainer.md."""
from .layout import (CONFIG_FILE, TRAINER_KEY, checkpoint_state, checkpoint_step, ckpt_backend, list_checkpoints,
                     resolve_resume)
from .manager import CheckpointManager, Resumed, Saved, is_better

__all__ = ["CheckpointManager", "Resumed", "Saved", "is_better", "ckpt_backend", "TRAINER_KEY", "CONFIG_FILE",
           "list_checkpoints", "checkpoint_step", "checkpoint_state", "resolve_resume"]
