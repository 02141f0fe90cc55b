"""TrainerArgs and the component configs; loading from YAML with overrides and references."""
from .components import (CheckpointConfig, DataloaderConfig, DatasetConfig, DatasetSamplerConfig, HookConfig,
                         HookMapConfig, LogConfig, LRSchedulerConfig, ModelConfig, ModuleParallelizeConfig,
                         OptimizerConfig, OptionalComputeConfig)
from .trainer_args import TrainerArgs
from .loading import dump_yaml, load_config

__all__ = ["CheckpointConfig", "DataloaderConfig", "DatasetConfig", "DatasetSamplerConfig", "HookConfig",
           "HookMapConfig", "LogConfig", "LRSchedulerConfig", "ModelConfig", "ModuleParallelizeConfig",
           "OptimizerConfig", "OptionalComputeConfig", "TrainerArgs", "dump_yaml", "load_config"]
