"""nnscaler.ir: the intermediate representation, and the one package every other depends on.

What other packages use is exported here (and from the public sub-packages
`nnscaler.ir.contracts` and `nnscaler.ir.schedules`); they import nothing else of ir
(tests/test_package_dependencies.py checks it). By concern:

- configuration: `ComputeConfig`, `OptionalComputeConfig`, `ConfigWarning`, `warn_ineffective_settings`;
- errors: `NnScalerError` (the base every package derives from), `NnScalerWarning`, `ConfigError`,
  `GenerationError`, `TraceError`, `TracingWarning`, `AnnotationError`, `LayoutError`;
- tracing: `trace()` into an `IRGraph` of `Node` s over `Ref` s; guards, branches and random ops
  of the traced program (`is_guard`, `keep_traced_branch`, `branch_refs`, `node_random_kind`);
- ops: `register_op`, `REGISTRY`, `parse_annotation`;
- layouts: `Replicate`, `Shard`, `Partial`, `TensorLayout`, and the collectives between them
  (`transition_steps`, `steps_cost`, `step_collectives`, `STEP_COLLECTIVES`, `CommCost`, `COST_MODELS`);
- plans: `PipelinePlan` (the plan report, `PlanReport`, is a contract: `nnscaler.ir.contracts`);
- helpers shared by every package: `warn_user` / `is_internal` (errors point at the user's code),
  `iter_tensors` / `map_tensors` (nested containers), `atomic_write` / `AtomicFile`, `policy_name`,
  `module_of`, `resolve_target` (the function an op's dotted target names).
"""
from .config import ComputeConfig, OptionalComputeConfig, as_compute_config
from .errors import ConfigError, GenerationError, NnScalerError, NnScalerWarning, TraceError, TracingWarning
from .config_checks import ConfigWarning, warn_ineffective_settings
from .graph import IRGraph, InputSpec, Node, Ref, SourceLoc, TensorSpec, Value, decode, dtype_name, iter_refs
from .layout import LayoutError, Partial, Replicate, Shard, TensorLayout
from .transitions import COST_MODELS, STEP_COLLECTIVES, CommCost, step_collectives, steps_cost, transition_steps
from .pipeline_plan import PipelinePlan
from .tracer.trace import trace
from .tracer.guards import READ_TEXT, close as guard_values_close, digest as guard_digest, is_guard
from .tracer.branches import branch_refs, keep_traced_branch
from .ops.random_ops import LIKE, MASK, node_random_kind
from .user_code import is_internal, warn_user
from .tree import iter_tensors, map_tensors, replace_tensors, tensor_leaves
from .atomic_write import TMP_SUFFIX, AtomicFile, atomic_write, exchange_paths, fsync_dir
from .ops.op_names import module_of, policy_name, resolve as resolve_target
from .ops.annotation import AnnotationError, parse_annotation
from .ops.registry import REGISTRY, register_op  # (importing it registers the built-in annotations)
from .ops.moe import (EXPERT_DIM, ROUTED_EXPERTS, expert_group, expert_group_dim, ExpertMLP, combine as combine_experts,
                      dispatch_order as experts_dispatch_order, expert_mlp, routed_experts,  # mixture of experts
                      expert_capacity, slot_counts, kept_counts, drop_over_capacity, with_dropped,  # (capacity)
                      packed_expert_width)  # (ep_size k: the gathered experts' packing)
from .tracer.moe_modules import experts_recorded_whole, set_capacity_factor  # transformers' experts modules
from .ops.context_parallel import (CROSS_ENTROPY, RING_DIM, SDPA,  # attention with its sequence split (ring attention)
                                   SEQUENCE_LOSS_DIM)  # and the mean loss over a split sequence

__all__ = [
    "EXPERT_DIM", "ROUTED_EXPERTS", "expert_group", "expert_group_dim", "ExpertMLP", "combine_experts", "experts_dispatch_order", "expert_mlp",
    "routed_experts", "expert_capacity", "slot_counts", "kept_counts", "drop_over_capacity", "with_dropped", "packed_expert_width",
    "experts_recorded_whole", "set_capacity_factor", "RING_DIM", "SDPA", "CROSS_ENTROPY", "SEQUENCE_LOSS_DIM",
    "ComputeConfig", "OptionalComputeConfig", "as_compute_config", "ConfigWarning", "warn_ineffective_settings",
    "NnScalerError", "NnScalerWarning", "ConfigError", "GenerationError", "TraceError", "TracingWarning",
    "AnnotationError", "LayoutError",
    "IRGraph", "InputSpec", "Node", "Ref", "SourceLoc", "TensorSpec", "Value", "decode", "dtype_name", "iter_refs",
    "trace", "READ_TEXT", "guard_values_close", "guard_digest", "is_guard", "branch_refs", "keep_traced_branch",
    "LIKE", "MASK", "node_random_kind",
    "REGISTRY", "register_op", "parse_annotation",
    "Replicate", "Shard", "Partial", "TensorLayout",
    "COST_MODELS", "STEP_COLLECTIVES", "CommCost", "step_collectives", "steps_cost", "transition_steps",
    "PipelinePlan",
    "warn_user", "is_internal", "iter_tensors", "map_tensors", "replace_tensors", "tensor_leaves",
    "TMP_SUFFIX", "AtomicFile", "atomic_write", "exchange_paths", "fsync_dir", "module_of", "policy_name", "resolve_target",
]
