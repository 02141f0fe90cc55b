"""TrainerArgs: every setting of a run (docs/trainer.md lists them), with the values derived from it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from nnscaler.ir import ComputeConfig

from .argv import split_argv
from .checks import validate as validate_args
from .components import (CheckpointConfig, DataloaderConfig, DatasetConfig, DatasetSamplerConfig, HookConfig,
                         HookMapConfig, LogConfig, LRSchedulerConfig, ModelConfig, OptimizerConfig, PrecisionSetting)
from .loading import load_config
from .typed import from_data, to_data
from .values import local_name

__all__ = ["TrainerArgs"]


@local_name
@dataclass
class TrainerArgs:
    """Every setting of a training run; components by fully qualified name plus arguments.

    Build it from a dict / YAML with `TrainerArgs.from_dict` / `from_yaml` (unknown keys and
    wrong types are errors naming the key), or directly; `validate()` checks the whole (the
    Trainer calls it before anything starts)."""

    compute_config: ComputeConfig = None

    gen_savedir: str = "./.nnscaler"
    gen_reuse: str = "auto"  # auto: moo for compile, match for run
    pas_policy: str = "autodist"
    broadcast_strategy: str = "all"
    instance_name: str = None
    run_mode: str = "run"
    tracing_from_weights: str = None

    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    dataloader: DataloaderConfig = field(default_factory=DataloaderConfig)
    dataset_sampler: DatasetSamplerConfig = field(default_factory=DatasetSamplerConfig)
    lr_scheduler: Optional[LRSchedulerConfig] = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: List[LogConfig] = field(default_factory=list)
    hook: Union[HookConfig, HookMapConfig, None] = None

    precision: PrecisionSetting = None

    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None
    grad_accumulation_steps: Optional[int] = None

    max_epochs: Optional[int] = None
    max_train_steps: Optional[int] = None
    max_val_steps: Optional[int] = None

    val_every_n_train_steps: Optional[int] = None
    val_every_n_epochs: Optional[int] = 1

    enable_progress_bar: bool = True

    seed: Optional[int] = None
    init_env_fn: str = None
    # seconds a collective waits for every rank before each waiting rank raises (the default
    # process group's timeout; 600 is torch's NCCL default)
    collective_timeout: float = 600

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Dict[str, Any], validate: bool = True) -> "TrainerArgs":
        """From plain data (a parsed YAML file); a top-level ``vars`` section (values for
        ``${vars.x}`` references) is dropped. Errors name the key path."""
        data = {k: v for k, v in (data or {}).items() if k != "vars"}
        args = from_data(cls, data, "")
        if validate:
            args.validate()
        return args

    @classmethod
    def from_yaml(cls, path: str, overrides: Optional[List[str]] = None, validate: bool = True) -> "TrainerArgs":
        """Load a YAML file, apply command-line overrides (``['--max_epochs', '2']``), resolve
        ``${...}`` references, and build the args."""
        return cls.from_dict(load_config(path, overrides or []), validate=validate)

    @classmethod
    def from_argv(cls, argv: List[str], run_mode: Optional[str] = None) -> "TrainerArgs":
        """From a command line: ``-f CONFIG.yaml`` and overrides (``--max_epochs 2``); the
        launcher's own ``--nproc`` / ``--print-config`` are accepted and left to the command."""
        return cls.from_dict(split_argv(argv).config_data(run_mode))

    def to_dict(self) -> Dict[str, Any]:
        """Plain data that `from_dict` turns back into equal args."""
        return to_data(self)

    def validate(self) -> "TrainerArgs":
        """Check the whole config (every rule of config/checks.py); raises TrainerConfigError."""
        validate_args(self)
        return self

    # -- derived values --------------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        """The data-parallel degree: runtime_ngpus // plan_ngpus."""
        return self.compute_config.runtime_ngpus // self.compute_config.plan_ngpus

    @property
    def update_freq(self) -> int:
        """Micro-batches per optimizer step on each rank (grad_accumulation_steps, derived from
        global_batch_size when only that is set)."""
        if self.grad_accumulation_steps is not None:
            return self.grad_accumulation_steps
        if self.global_batch_size is not None:
            return self.global_batch_size // (self.micro_batch_size * self.dp_size)
        return 1

    @property
    def resolved_global_batch_size(self) -> int:
        """Samples per optimizer step over all replicas."""
        return self.micro_batch_size * self.dp_size * self.update_freq

    @property
    def resolved_gen_reuse(self) -> str:
        """``auto`` resolved: ``moo`` when compiling, ``match`` when running."""
        if self.gen_reuse != "auto":
            return self.gen_reuse
        return "moo" if self.run_mode == "compile" else "match"

    @property
    def uses_parallel_modules(self) -> bool:
        return bool(self.model.parallel_modules)
