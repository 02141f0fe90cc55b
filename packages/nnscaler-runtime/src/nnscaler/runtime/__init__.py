"""nnscaler.runtime: what generated code imports, and `parallelize()`.

`ParallelModule` (the base of generated per-rank modules), the `RankGrid` that owns every
process group, the data-parallel `Reducer`, `build_optimizer`, `sync_grad_when`, and
`parallelize()` / `ReuseType`. Code generation itself (nnscaler-policies, nnscaler-codegen) is
imported only when code must be generated: install ``nnscaler-runtime[compile]`` for that.
"""
from . import comm
from . import random  # random streams of generated code (nr.random.*)
from . import sync_batchnorm  # batch statistics over data-parallel replicas (nr.sync_batchnorm.*)
from . import ring_attention  # context parallelism (nr.ring_attention.attention)
from . import sequence_loss  # the mean loss over a sequence split by context parallelism
from . import moe  # expert parallelism (nr.moe.expert_parallel)
from .device import default_backend, default_device
from .errors import ConfigError, GenerationError, NnScalerError, PlanMismatchError, ReuseError
from . import failures  # a failed step reaches every rank (nr.failures: run, install_excepthook, ...)
from .failures import CollectiveTimeoutError, PeerFailedError, StepRefusedError
from . import guards  # run-time checks of the trace's decisions on tensor values (nr.guards.check)
from .guards import GuardError
from .driver.gen_dir import ReuseType
from .gradients import (AggregatedOutputs, aggregate_outputs, clear_grads, count_tokens, grad_scale,
                        reduce_gradients, reduce_loss)
from .class_mixin import mix_into, rewrap_scheduler_step
from .grid import RankGrid
from .module import ParallelModule
from .call_arguments import ForwardArgumentError  # a call that does not fit the model's forward
from .optimizer import build_optimizer, plain_trainables
from .optimizer_state import ModuleState, OptimizerState, module_state, optimizer_state  # one owner of our state
from .zero3 import FullyShardedParams  # use_zero=3 (pm.fully_sharded)
from .offload import OffloadedOptimizer, offload_optimizer, step_gradients  # optimizer state on another device
from .driver.parallelize import load_generated_class, parallelize
from .driver.meta_init import has_meta_tensors
from .driver.plan_report import PlanWarning
from .driver.model_sources import SourceChangedWarning  # reuse='match' of code from an edited model
from .precision import (GradScaler, MixedPrecisionOptimizer, PrecisionConfig, PrecisionPlugin, apply_precision,
                        parse_precision, with_master_weights)
from .reducer import Reducer, sync_grad_when
from nnscaler.ir.contracts import ZeroShardLayout

__all__ = [
    "AggregatedOutputs", "aggregate_outputs", "clear_grads", "mix_into", "rewrap_scheduler_step", "count_tokens", "grad_scale", "reduce_gradients", "reduce_loss",
    "GradScaler", "MixedPrecisionOptimizer", "PrecisionConfig", "PrecisionPlugin", "apply_precision",
    "parse_precision", "with_master_weights",
    "ZeroShardLayout", "comm", "ConfigError", "GenerationError", "GuardError", "guards", "NnScalerError", "ParallelModule", "PlanMismatchError", "RankGrid",
    "Reducer", "ReuseError", "ReuseType", "build_optimizer", "default_backend", "default_device",
    "load_generated_class", "parallelize", "has_meta_tensors", "sync_grad_when", "PlanWarning", "SourceChangedWarning", "sync_batchnorm", "moe", "ring_attention", "sequence_loss", "failures",
    "PeerFailedError", "StepRefusedError", "CollectiveTimeoutError", "ForwardArgumentError",
    "OffloadedOptimizer", "offload_optimizer", "step_gradients",
    "plain_trainables", "OptimizerState", "ModuleState", "optimizer_state", "module_state", "FullyShardedParams",
]
