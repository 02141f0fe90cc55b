"""`AutodistConfig`: every `pas_config` key of the `autodist` policy, checked once.

The keys are the documented autodist `pas_config` keys (docs/autodist.md); keys starting with ``_`` are the
user's own (they change the generated code's identity, nothing else) or autodist's private
knobs (``_comm_profile``, ``_solver_time_limit``, ``_profile_repeats``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from nnscaler.ir import ConfigError
from nnscaler.ir.contracts import kept_after_forward
from nnscaler.ir.contracts import mixed_precision

__all__ = ["AutodistConfig", "KEYS"]

# key -> (type description, default)
KEYS: Dict[str, Tuple[str, Any]] = {
    "update_freq": ("int >= 1", 1),
    "mem_constraint": ("GB per device (number > 0)", None),
    "task_name": ("str", "default"),
    "use_fp16": ("bool", False),
    "use_memory_efficient_fp16": ("bool", False),
    "use_bf16": ("bool", False),
    "use_memory_efficient_bf16": ("bool", False),
    "re_profile": ("bool", False),
    "verbose": ("bool", False),
    "load_plan_path": ("path of a plan JSON", None),
    "save_plan_path": ("path to write the plan JSON", None),
    "partition_constraints_path": ("path of a constraints YAML", None),
    "recompute_modules": ("module class names or path globs, comma-separated", ""),
    "pipeline_pivots": ("module class names or path globs, comma-separated", ""),
    "pipeline_nstages": ("'auto' or int >= 1", "auto"),
    "pipeline_nmicros": ("int >= 1 (default: update_freq)", None),
    "pipeline_scheduler": ("'1f1b'", "1f1b"),
    "use_apex_fused_adam_v2": ("bool", False),
    "parallel_profile": ("bool", True),
    "max_partition_degree": ("int >= 1 (default plan_ngpus)", None),
    "transient_mem_coef": ("number >= 0", 2.0),
    "zero3_mixed_precision": ("{'param_dtype': ..., 'reduce_dtype': ..., 'units': {glob: {...}}} (ZeRO-3's gather / "
                              "compute and gradient reduce dtypes, FSDP2's MixedPrecisionPolicy; read by the "
                              "trace and the runtime)", None),
    "zero3_units": ("module classes, path globs or module paths, a list or comma-separated (ZeRO-3's gathered "
                    "units; read by the code generator too)", []),
    "zero3_reshard_after_forward": ("True, False, an int dividing the zero group size, or a mapping of unit "
                                    "names or globs to those (FSDP2's reshard_after_forward of ZeRO-3's units: "
                                    "kept gathered, or held by a smaller group, from forward to backward; read by "
                                    "the runtime)", True),
}


@dataclass
class AutodistConfig:
    plan_ngpus: int
    runtime_ngpus: int
    use_zero: int = 0  # the ZeRO stage (ComputeConfig.zero_stage): 0 none, 1 optimizer state, 3 fully sharded
    zero_ngroups: int = 1
    zero_use_reduce_scatter: bool = False
    update_freq: int = 1
    mem_constraint: Optional[float] = None  # GB
    task_name: str = "default"
    use_fp16: bool = False
    use_memory_efficient_fp16: bool = False
    use_bf16: bool = False
    use_memory_efficient_bf16: bool = False
    re_profile: bool = False
    verbose: bool = False
    load_plan_path: Optional[str] = None
    save_plan_path: Optional[str] = None
    partition_constraints_path: Optional[str] = None
    recompute_modules: List[str] = field(default_factory=list)
    pipeline_pivots: List[str] = field(default_factory=list)
    pipeline_nstages: Any = "auto"
    pipeline_nmicros: Optional[int] = None
    pipeline_scheduler: str = "1f1b"
    use_apex_fused_adam_v2: bool = False
    parallel_profile: bool = True
    max_partition_degree: Optional[int] = None
    transient_mem_coef: float = 2.0
    comm_profile: Optional[dict] = None  # _comm_profile: a measured profile given directly
    solver_time_limit: float = 10.0
    profile_repeats: int = 3
    bucket_cap_bytes: float = 25 * 1024 ** 2  # the reducer's gradient bucket (ComputeConfig.bucket_cap_mb)
    optimizer_states: int = 2  # fp32 tensors of optimizer state per parameter (Adam: exp_avg, exp_avg_sq)
    zero3_units: List[str] = field(default_factory=list)  # module paths gathered as one unit under ZeRO-3
    zero3_reshard_after_forward: Any = True  # read by the runtime (contracts.kept_after_forward); not priced
    zero3_mixed_precision: Any = None  # read by the trace and the runtime (contracts.mixed_precision); not priced

    @property
    def zero_stage(self) -> int:
        """0, 1 or 3: `use_zero` as ComputeConfig.zero_stage reads it (True is stage 1)."""
        return 3 if self.use_zero == 3 and not isinstance(self.use_zero, bool) else int(bool(self.use_zero))

    @property
    def zero_group(self) -> int:
        """Ranks a ZeRO shard is spread over: dp_size // zero_ngroups with ZeRO, else 1."""
        if not self.use_zero or self.dp_size <= 1:
            return 1
        return max(1, self.dp_size // max(1, self.zero_ngroups))

    @property
    def dp_size(self) -> int:
        return self.runtime_ngpus // self.plan_ngpus

    @property
    def mem_limit_bytes(self) -> Optional[float]:
        return None if self.mem_constraint is None else self.mem_constraint * 1024 ** 3

    @property
    def nmicros(self) -> int:
        return self.pipeline_nmicros or self.update_freq

    @classmethod
    def from_compute_config(cls, cfg) -> "AutodistConfig":
        pas = dict(cfg.pas_config or {})
        unknown = sorted(k for k in pas if not str(k).startswith("_") and k not in KEYS)
        if unknown:
            raise ConfigError(f"pas_policy 'autodist' does not know pas_config key(s) {', '.join(map(repr, unknown))}; "
                              f"its keys are {', '.join(sorted(KEYS))} (prefix your own keys with '_')")
        out = cls(plan_ngpus=cfg.plan_ngpus, runtime_ngpus=cfg.runtime_ngpus, use_zero=_zero_stage(cfg.use_zero),
                  zero_ngroups=getattr(cfg, "zero_ngroups", 1) or 1,
                  zero_use_reduce_scatter=bool(getattr(cfg, "zero_use_reduce_scatter", False)))
        if getattr(cfg, "bucket_cap_mb", None):
            out.bucket_cap_bytes = float(cfg.bucket_cap_mb) * 1024 ** 2
        for key in ("use_fp16", "use_memory_efficient_fp16", "use_bf16", "use_memory_efficient_bf16",
                    "re_profile", "verbose", "use_apex_fused_adam_v2", "parallel_profile"):
            if key in pas:
                setattr(out, key, _bool(key, pas[key]))
        if "update_freq" in pas:
            out.update_freq = _int("update_freq", pas["update_freq"])
        if pas.get("mem_constraint") is not None:
            out.mem_constraint = _positive("mem_constraint", pas["mem_constraint"])
        if "task_name" in pas:
            out.task_name = _str("task_name", pas["task_name"])
        for key in ("load_plan_path", "save_plan_path", "partition_constraints_path"):
            if pas.get(key) is not None:
                setattr(out, key, os.fspath(_path(key, pas[key])))
        for key in ("load_plan_path", "partition_constraints_path"):
            path = getattr(out, key)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"pas_config[{key!r}] = {path!r}: no such file; give the path of an existing "
                                  f"{'plan JSON (written by save_plan_path)' if key == 'load_plan_path' else 'constraints YAML'}")
        if "zero3_mixed_precision" in pas:
            mixed_precision(pas["zero3_mixed_precision"])  # its check (use_zero=3: checked by parallelize)
            out.zero3_mixed_precision = pas["zero3_mixed_precision"]
        if pas.get("zero3_units"):
            out.zero3_units = _name_list("zero3_units", pas["zero3_units"])
        if "zero3_reshard_after_forward" in pas:
            kept_after_forward((), pas["zero3_reshard_after_forward"],  # its check
                               out.runtime_ngpus // out.plan_ngpus // out.zero_ngroups if out.use_zero == 3 else None)
            out.zero3_reshard_after_forward = pas["zero3_reshard_after_forward"]
        for key in ("recompute_modules", "pipeline_pivots"):
            if pas.get(key):
                setattr(out, key, _names(key, pas[key]))
        if "pipeline_nstages" in pas:
            v = pas["pipeline_nstages"]
            out.pipeline_nstages = v if v == "auto" else _int("pipeline_nstages", v)
        if pas.get("pipeline_nmicros") is not None:
            out.pipeline_nmicros = _int("pipeline_nmicros", pas["pipeline_nmicros"])
        if "pipeline_scheduler" in pas and pas["pipeline_scheduler"] != "1f1b":
            raise ConfigError(f"pas_config['pipeline_scheduler'] = {pas['pipeline_scheduler']!r}: autodist plans "
                              f"pipelines for the '1f1b' schedule only (its bubble is in the estimate); use "
                              f"pas_policy='hybrid' for other schedules")
        if pas.get("max_partition_degree") is not None:
            out.max_partition_degree = _int("max_partition_degree", pas["max_partition_degree"])
            if out.max_partition_degree > cfg.plan_ngpus:
                raise ConfigError(f"pas_config['max_partition_degree'] = {out.max_partition_degree} is more than "
                                  f"plan_ngpus ({cfg.plan_ngpus}); use at most plan_ngpus")
        if "transient_mem_coef" in pas:
            out.transient_mem_coef = _nonneg("transient_mem_coef", pas["transient_mem_coef"])
        if out.pipeline_nstages != "auto":
            if out.pipeline_nstages == 1 and out.pipeline_pivots:
                raise ConfigError("pas_config['pipeline_nstages'] = 1 turns the pipeline off, so pipeline_pivots must "
                                  "not be set; remove it, or set pipeline_nstages > 1 or 'auto'")
            if out.pipeline_nstages > 1 and not out.pipeline_pivots:
                raise ConfigError(f"pas_config['pipeline_nstages'] = {out.pipeline_nstages} needs pipeline_pivots "
                                  f"(the module class names where stages may start, e.g. 'Block')")
            if out.pipeline_nstages > 1 and cfg.plan_ngpus % out.pipeline_nstages:
                raise ConfigError(f"pas_config['pipeline_nstages'] = {out.pipeline_nstages} must divide plan_ngpus "
                                  f"({cfg.plan_ngpus})")
        if out.pipeline_pivots and not cfg.use_end2end:
            raise ConfigError("pas_config['pipeline_pivots'] lets autodist pipeline the model, which runs only end to "
                              "end: set ComputeConfig(use_end2end=True), or remove pipeline_pivots")
        if "_comm_profile" in pas:
            out.comm_profile = pas["_comm_profile"]
        if "_solver_time_limit" in pas:
            out.solver_time_limit = _positive("_solver_time_limit", pas["_solver_time_limit"])
        if "_profile_repeats" in pas:
            out.profile_repeats = _int("_profile_repeats", pas["_profile_repeats"])
        if "_optimizer_states" in pas:
            out.optimizer_states = _int("_optimizer_states", pas["_optimizer_states"], minimum=0)
        return out


def _zero_stage(v) -> int:
    """ComputeConfig.use_zero as a stage: False/0 -> 0, True/1 -> 1, 3 -> 3; anything else is refused."""
    if isinstance(v, bool) or v in (0, 1):
        return int(bool(v))
    if isinstance(v, int) and v == 3:
        return 3
    raise ConfigError(f"ComputeConfig.use_zero must be False/0, True/1 (ZeRO-1: optimizer state sharded) or 3 "
                      f"(ZeRO-3: parameters, gradients and optimizer state sharded), got {v!r}")


def _name_list(key, v) -> List[str]:
    """Module classes, path globs or paths: a list, or one string separated by commas."""
    if isinstance(v, str):
        v = [x for x in v.split(",") if x.strip()]
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(x, str) and x.strip() for x in v):
        raise ConfigError(f"pas_config[{key!r}] must name module classes, path globs or module paths (a list, "
                          f"or a string separated by commas: e.g. 'LlamaDecoderLayer' or ['model.layers.*']), "
                          f"got {v!r}")
    return [x.strip() for x in v]


def _bool(key, v) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"pas_config[{key!r}] must be true or false, got {v!r}")
    return v


def _int(key, v, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"pas_config[{key!r}] must be an integer >= {minimum}, got {v!r}")
    return v


def _positive(key, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ConfigError(f"pas_config[{key!r}] must be a number > 0, got {v!r}")
    return float(v)


def _nonneg(key, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise ConfigError(f"pas_config[{key!r}] must be a number >= 0, got {v!r}")
    return float(v)


def _str(key, v) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(f"pas_config[{key!r}] must be a non-empty string, got {v!r}")
    return v


def _path(key, v):
    if not isinstance(v, (str, os.PathLike)) or not os.fspath(v):
        raise ConfigError(f"pas_config[{key!r}] must be a file path, got {v!r}")
    return v


def _names(key, v) -> List[str]:
    if isinstance(v, str):
        names = [s.strip() for s in v.split(",") if s.strip()]
    elif isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v):
        names = [s.strip() for s in v if s.strip()]
    else:
        raise ConfigError(f"pas_config[{key!r}] must be module names separated by ',' (e.g. 'Block,Attention'), "
                          f"got {v!r}")
    return names
