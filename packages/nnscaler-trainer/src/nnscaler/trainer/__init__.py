"""nnscaler.trainer: TrainerArgs, Trainer and `nnscaler train`."""
