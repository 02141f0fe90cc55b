"""ComputeConfig: the compute environment and code-generation switches of one parallelization.

The fields and defaults users set (docs/trainer.md lists them) plus the optional fields of
`OptionalComputeConfig` (`use_async_reducer`, `reducer_bucket_cap_mb`,
`zero_use_reduce_scatter`). Every value is checked on construction and a
bad one raises `ConfigError` naming the field and what to do.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Union

TRACE_STRATEGIES = ("cpu", "cuda", "meta", "cuda_run_cpu_offload", "reuse_cache")
DEFAULT_BUCKET_CAP_MB = 25.0
RNG_MODES = ("parallel", "exact")
ZERO_STAGES = (0, 1, 3)


from .errors import ConfigError  # noqa: E402  (re-exported: nnscaler.ir.config.ConfigError)


def _check_type(name: str, value: Any, types, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    # bool is an int subclass: do not let True pass as a count.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ConfigError(f"ComputeConfig.{name} must be {_type_names(types)}, got bool {value!r}")
    if not isinstance(value, types):
        raise ConfigError(
            f"ComputeConfig.{name} must be {_type_names(types)}, got {type(value).__name__} {value!r}")


def _check_zero(value: Any) -> None:
    if isinstance(value, bool) or (isinstance(value, int) and value in ZERO_STAGES):
        return
    raise ConfigError(
        f"ComputeConfig.use_zero must be False/0 (no ZeRO), True/1 (optimizer state sharded over the "
        f"data-parallel ranks) or 3 (parameters, gradients and optimizer state sharded: fully sharded), "
        f"got {type(value).__name__} {value!r}")


def _type_names(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in types)


def _check_json(name: str, value: Dict[str, Any]) -> None:
    try:
        text = json.dumps(value, sort_keys=True, allow_nan=False)
        if json.loads(text) != value:  # int keys or tuples would come back changed: never matches again
            raise ValueError("it does not survive a JSON round trip (tuples or non-str dict keys?)")
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"ComputeConfig.{name} must hold only JSON values (str, numbers, bools, None, lists, "
            f"dicts with str keys) because it is saved with the generated code: {e}") from None


@dataclass(frozen=True)
class ComputeConfig:
    """Where and how a module is parallelized.

    `plan_ngpus` devices hold one copy of the model (partitioned by the policy); `runtime_ngpus`
    is the world size and must be a multiple of it; the data-parallel degree is their quotient.
    """

    plan_ngpus: int
    runtime_ngpus: int

    constant_folding: bool = False
    trace_strategy: str = "cuda_run_cpu_offload"

    # ZeRO: False/0 none; True/1 optimizer state sharded over the data-parallel ranks (stage 1);
    # 3 parameters, gradients and optimizer state sharded (fully sharded, nnscaler.runtime.zero3)
    use_zero: Union[bool, int] = False
    zero_ngroups: int = 1
    zero_use_reduce_scatter: bool = False

    use_async_reducer: bool = False
    reducer_bucket_cap_mb: Optional[float] = None

    inference_only: bool = False
    use_end2end: bool = False

    # random ops of the generated forward (nnscaler.runtime.random, docs/tracing.md "Random numbers"):
    # "parallel" = one stream per replica, "exact" = the single-device run's masks
    rng_mode: str = "parallel"

    # training-mode batch norm computes its batch statistics over all data-parallel replicas
    # (nnscaler.runtime.sync_batchnorm, docs/tracing.md "BatchNorm under data parallelism")
    sync_batchnorm: bool = False

    pas_config: Dict[str, Any] = field(default_factory=dict)
    user_config: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for name in ("plan_ngpus", "runtime_ngpus", "zero_ngroups"):
            _check_type(name, getattr(self, name), int)
            if getattr(self, name) < 1:
                raise ConfigError(f"ComputeConfig.{name} must be a positive integer, got {getattr(self, name)}")
        if self.runtime_ngpus % self.plan_ngpus:
            raise ConfigError(
                f"ComputeConfig.runtime_ngpus ({self.runtime_ngpus}) must be a multiple of plan_ngpus "
                f"({self.plan_ngpus}): every plan_ngpus ranks hold one copy of the model. "
                f"Use runtime_ngpus={self.plan_ngpus * max(1, self.runtime_ngpus // self.plan_ngpus)} "
                f"or change plan_ngpus.")
        _check_zero(self.use_zero)
        for name in ("constant_folding", "zero_use_reduce_scatter", "use_async_reducer",
                     "inference_only", "use_end2end", "sync_batchnorm"):
            _check_type(name, getattr(self, name), bool)
        _check_type("trace_strategy", self.trace_strategy, str)
        if self.trace_strategy not in TRACE_STRATEGIES:
            raise ConfigError(
                f"ComputeConfig.trace_strategy must be one of {', '.join(TRACE_STRATEGIES)}; "
                f"got {self.trace_strategy!r}")
        _check_type("rng_mode", self.rng_mode, str)
        if self.rng_mode not in RNG_MODES:
            raise ConfigError(
                f"ComputeConfig.rng_mode must be one of {', '.join(map(repr, RNG_MODES))}, got {self.rng_mode!r}: "
                f"'parallel' (default) gives every replica one random stream, 'exact' reproduces the "
                f"single-device run's random numbers (dropout masks) for parity tests")
        _check_type("reducer_bucket_cap_mb", self.reducer_bucket_cap_mb, (int, float), allow_none=True)
        if self.reducer_bucket_cap_mb is not None and not self.reducer_bucket_cap_mb > 0:
            raise ConfigError(
                f"ComputeConfig.reducer_bucket_cap_mb must be > 0 (MB per gradient bucket), "
                f"got {self.reducer_bucket_cap_mb}")
        if not self.use_zero and self.zero_ngroups > 1:  # refused, not only warned about at parallelize
            raise ConfigError(
                f"ComputeConfig.zero_ngroups={self.zero_ngroups} needs use_zero=True: it splits ZeRO's "
                f"optimizer-state sharding into groups, and without use_zero nothing is sharded. Set "
                f"use_zero=True to shard the optimizer state, or leave zero_ngroups at 1")
        if self.use_zero:
            dp = self.runtime_ngpus // self.plan_ngpus
            if dp % self.zero_ngroups:
                raise ConfigError(
                    f"ComputeConfig.zero_ngroups ({self.zero_ngroups}) must divide the data-parallel "
                    f"degree runtime_ngpus // plan_ngpus = {dp}")
        for name in ("pas_config", "user_config"):
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, {})
                continue
            _check_type(name, value, dict)
            _check_json(name, value)
        if "zero3_reshard_after_forward" in self.pas_config:  # its values, and under use_zero=3 k | zero group
            from .contracts.shard_units import reshard_sizes
            reshard_sizes((), self.pas_config["zero3_reshard_after_forward"],
                          self.dp_size // self.zero_ngroups if self.zero_stage == 3 else None)
        if "zero3_mixed_precision" in self.pas_config:  # its keys and dtypes; a policy needs use_zero=3 training
            from .contracts.shard_precision import mixed_precision
            mixed_precision(self.pas_config["zero3_mixed_precision"], self.zero_stage, self.inference_only)

    # -- derived values ------------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        """The data-parallel degree: runtime_ngpus // plan_ngpus."""
        return self.runtime_ngpus // self.plan_ngpus

    @property
    def zero_stage(self) -> int:
        """0 (no ZeRO), 1 (optimizer state sharded: use_zero=True/1) or 3 (parameters, gradients and
        optimizer state sharded: use_zero=3)."""
        return 3 if self.use_zero == 3 and not isinstance(self.use_zero, bool) else int(bool(self.use_zero))

    @property
    def bucket_cap_mb(self) -> float:
        """The gradient bucket size in MB actually used (the default when unset)."""
        return DEFAULT_BUCKET_CAP_MB if self.reducer_bucket_cap_mb is None else float(self.reducer_bucket_cap_mb)

    # -- (de)serialisation ---------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "ComputeConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown ComputeConfig field(s) {', '.join(unknown)}; known fields: {', '.join(sorted(known))}")
        return cls(**data)

    def graph_key(self) -> Dict[str, Any]:
        """The fields that change the traced graph (used by ReuseType.GRAPH)."""
        return {"constant_folding": self.constant_folding, "user_config": self.user_config}

    def differences(self, other: "ComputeConfig") -> Dict[str, tuple]:
        """field -> (self value, other value) for every field that differs."""
        mine, theirs = self.to_dict(), other.to_dict()
        return {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}


def as_compute_config(value: Any) -> ComputeConfig:
    """`value` as a ComputeConfig: one as it is, its dict (``to_dict()``, the generated code's
    ``COMPUTE_CONFIG``) through `ComputeConfig.from_dict` (validated; unknown fields refused)."""
    if isinstance(value, ComputeConfig):
        return value
    if isinstance(value, dict):
        return ComputeConfig.from_dict(dict(value))
    raise TypeError(f"expected a ComputeConfig (or its dict), got {type(value).__name__}")


@dataclass(frozen=True)
class OptionalComputeConfig:
    """A partial ComputeConfig: None means "take the value from the base config"."""

    constant_folding: Optional[bool] = None
    trace_strategy: Optional[str] = None
    use_zero: Optional[Union[bool, int]] = None
    zero_ngroups: Optional[int] = None
    zero_use_reduce_scatter: Optional[bool] = None
    use_async_reducer: Optional[bool] = None
    reducer_bucket_cap_mb: Optional[float] = None

    pas_config: Optional[Dict[str, Any]] = None
    user_config: Optional[Dict[str, Any]] = None

    def resolve(self, base: ComputeConfig) -> ComputeConfig:
        """`base` with every field set here (not None) replaced; validated like any ComputeConfig."""
        overrides = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return dataclasses.replace(base, **overrides)
