"""nnscaler.trainer: TrainerArgs, Trainer and ``nnscaler train``.

    from nnscaler.trainer import Trainer, TrainerArgs
    Trainer(train_args=TrainerArgs.from_yaml("cfg.yaml", ["--max_epochs", "2"])).run()

or ``nnscaler train -f cfg.yaml --nproc 2 --max_epochs 2``. See docs/trainer.md.
"""
from nnscaler.runtime import AggregatedOutputs

from .config import (CheckpointConfig, DataloaderConfig, DatasetConfig, DatasetSamplerConfig, HookConfig,
                     HookMapConfig, LogConfig, LRSchedulerConfig, ModelConfig, ModuleParallelizeConfig,
                     OptimizerConfig, OptionalComputeConfig, TrainerArgs)
from .errors import TrainerConfigError, TrainerConfigWarning, TrainerError
from .hooks import TrainHook
from .loggers import LoggerBase, TensorBoardLogger, WandbLogger
from .metrics import MoEMetrics, TrainStepMetrics, ValMetrics
from .moe import MoEModel
from .trainer import Trainer

__all__ = ["AggregatedOutputs", "CheckpointConfig", "DataloaderConfig", "DatasetConfig", "DatasetSamplerConfig",
           "HookConfig", "HookMapConfig", "LogConfig", "LoggerBase", "LRSchedulerConfig", "ModelConfig",
           "ModuleParallelizeConfig", "MoEMetrics", "MoEModel", "OptimizerConfig", "OptionalComputeConfig", "TensorBoardLogger", "Trainer",
           "TrainerArgs", "TrainerConfigError", "TrainerConfigWarning", "TrainerError", "TrainHook",
           "TrainStepMetrics", "ValMetrics", "WandbLogger"]
