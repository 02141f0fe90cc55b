"""nnscaler.trainer: TrainerArgs, Trainer and ``nnscaler train``.

Skeleton: this package has no code yet and exports nothing. It will hold ``TrainerArgs`` (every
setting of a run, components given by qualified name and arguments), ``Trainer`` (training and
validation loops over a parallelized model, hooks, loggers, checkpoints through nnscaler-ckpt)
and the ``nnscaler train`` / ``nnscaler compile`` commands (YAML config plus dotted overrides).
See the package README.
"""
