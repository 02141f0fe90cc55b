"""The component configs of TrainerArgs (docs/trainer.md describes each).

Each component is given by a fully qualified type (or factory) name plus its arguments; the
Trainer creates it. Argument values go through `nnscaler.trainer.config.values.build_value`
(``__type``, ``__value_type`` + ``value``, ``ast.literal_eval`` guessing of strings).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from nnscaler.ir import OptionalComputeConfig

# one precision for every tensor type, or a map 'param' | 'buffer' | 'input' -> 'fp32' | 'fp16' | 'bf16' | 'none'
PrecisionSetting = Union[str, Dict[str, str], None]

__all__ = [
    "ModuleParallelizeConfig", "ModelConfig", "OptimizerConfig", "DatasetConfig", "DataloaderConfig",
    "DatasetSamplerConfig", "LRSchedulerConfig", "CheckpointConfig", "LogConfig", "HookConfig",
    "HookMapConfig", "OptionalComputeConfig", "PrecisionSetting",
]


@dataclass
class ModuleParallelizeConfig:
    """A sub-module type to parallelize inside a plain model (``model.parallel_modules``).

    None fields take the TrainerArgs value; ``compute_config`` is merged over the trainer's."""

    type: str = None
    args: Dict[str, Any] = field(default_factory=dict)
    forward_args_gen_fn: str = None  # (trainer_args) -> dict of dummy forward args
    tracing_from_weights: str = None
    tracing_from_weights_prefix: str = None

    compute_config: Optional[OptionalComputeConfig] = None
    gen_savedir: Optional[str] = None
    gen_reuse: Optional[str] = None
    pas_policy: Optional[str] = None
    broadcast_strategy: Optional[str] = None
    instance_name: Optional[str] = None
    precision: PrecisionSetting = None


@dataclass
class ModelConfig:
    """The model class (not a factory) and its ``__init__`` arguments."""

    type: str = None
    args: Dict[str, Any] = field(default_factory=dict)
    parallel_modules: List[ModuleParallelizeConfig] = field(default_factory=list)


@dataclass
class OptimizerConfig:
    """The optimizer (first constructor parameter: the parameters), clipping and reductions."""

    type: str = None
    args: Dict[str, Any] = field(default_factory=dict)
    clip_gnorm: float = 0.0  # 0.0 / None: no clipping

    loss_reduction: str = "mean"  # mean | sum (validation always averages)
    grad_reduction: str = "mean"  # mean | sum | per-token-mean
    aggregate_outputs_fn: str = None  # (loss_outputs, sync_group) -> AggregatedOutputs


@dataclass
class DatasetConfig:
    """The dataset type (or factory) and the arguments of the train and validation datasets."""

    type: str = None
    train_args: Dict[str, Any] = field(default_factory=dict)
    val_args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class _TypeWithSplitArgs:
    """A class to build, with keyword arguments for each split."""

    type: str = ""
    train_args: Dict[str, Any] = field(default_factory=dict)
    val_args: Dict[str, Any] = field(default_factory=dict)
    test_args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DataloaderConfig(_TypeWithSplitArgs):
    """The dataloader type; ``dataset``, ``batch_size`` and ``sampler`` are set by the Trainer.
    ``val_args`` / ``test_args`` default to ``train_args`` when empty."""

    type: str = "torch.utils.data.DataLoader"  # a redefined field keeps its place: type stays first


@dataclass
class DatasetSamplerConfig(_TypeWithSplitArgs):
    """The sampler type; ``dataset``, ``num_replicas`` and ``rank`` are set by the Trainer."""

    type: str = "torch.utils.data.DistributedSampler"


@dataclass
class LRSchedulerConfig:
    """The LR scheduler (first constructor parameter: the optimizer), stepped every ``interval``."""

    type: str = None
    args: Dict[str, Any] = field(default_factory=dict)
    interval: str = "epoch"  # epoch | step


@dataclass
class CheckpointConfig:
    """Where and when checkpoints are saved (through nnscaler.ckpt) and what to resume from."""

    save_dir: str = "./checkpoints"
    no_save: bool = False

    save_type: str = "sharded"  # sharded | deduped

    save_last: bool = True
    save_best: bool = True
    symlink_best_and_last: bool = True

    every_n_train_steps: Optional[int] = None
    every_n_epochs: Optional[int] = None
    keep_last_n_checkpoints: Optional[int] = None
    async_save: bool = False  # write in a background process (nnscaler.ckpt.async_save); training goes on

    resume_from: str = None  # last | best | auto (last if save_dir holds one, else a fresh start) | a directory


@dataclass
class LogConfig:
    """A logger: ``nnscaler.trainer.TensorBoardLogger``, ``nnscaler.trainer.WandbLogger`` or yours."""

    type: str = None
    args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class HookConfig:
    """A hook class (usually a `TrainHook` subclass) or factory, and its arguments."""

    type: str = None
    args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class HookMapConfig:
    """Hook functions by fully qualified name; each is called with the Trainer first."""

    after_setup: str = None
    on_finalize: str = None

    on_train_start: str = None
    on_train_end: str = None
    on_val_start: str = None
    on_val_end: str = None

    on_epoch_start: str = None
    on_epoch_end: str = None

    on_train_step_start: str = None
    on_train_step_end: str = None
    on_val_step_start: str = None
    on_val_step_end: str = None

    on_step_start: str = None
    on_step_end: str = None

    after_aggregate_train_step_outputs: str = None
    after_aggregate_val_step_outputs: str = None

    before_zero_grad: str = None
    after_zero_grad: str = None

    before_sync_grad: str = None
    after_sync_grad: str = None

    before_gnorm_clip: str = None
    after_gnorm_clip: str = None

    before_optimizer_step: str = None
    after_optimizer_step: str = None

    before_log_train_metrics: str = None
    before_log_val_metrics: str = None

    on_load_checkpoint: str = None
    on_save_checkpoint: str = None
