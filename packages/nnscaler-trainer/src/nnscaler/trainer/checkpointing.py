"""The former home of the checkpoint names; they live in `nnscaler.trainer.checkpoints` now."""
from .checkpoints import (CONFIG_FILE, TRAINER_KEY, CheckpointManager, checkpoint_state, checkpoint_step,
                          ckpt_backend, list_checkpoints, resolve_resume)

__all__ = ["CheckpointManager", "ckpt_backend", "TRAINER_KEY", "CONFIG_FILE", "list_checkpoints", "checkpoint_step",
           "checkpoint_state", "resolve_resume"]
