"""Mixed precision of fully sharded data parallelism (``use_zero=3``), as FSDP2's
``MixedPrecisionPolicy``: ``pas_config["zero3_mixed_precision"]`` read into a typed policy that
the runtime (the gathers and reduce-scatters of `nnscaler.runtime.zero3`) and the driver (which
traces the forward in the units' ``param_dtype``) both apply.

The setting is a mapping (JSON: dtypes by name)::

    {"param_dtype": "bfloat16",            # gathers and compute (None: the shards' dtype)
     "reduce_dtype": "float32",            # the gradient reduce-scatter (None: param_dtype)
     "units": {"lm_head": {"param_dtype": "float32"}}}   # per unit (names or globs, first match)

The shards (and so the optimizer's masters) keep the dtype the module was built in."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

import torch

from ..errors import ConfigError

__all__ = ["KEY", "DTYPE_NAMES", "UnitPrecision", "MixedPrecision", "mixed_precision"]

KEY = "zero3_mixed_precision"
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "float64": torch.float64,
               "fp64": torch.float64}
_FIELDS = ("param_dtype", "reduce_dtype")


@dataclass(frozen=True)
class UnitPrecision:
    """One unit's policy: `param_dtype` the dtype it is gathered and computed in (None: its shard's),
    `reduce_dtype` the dtype its gradients are reduce-scattered in (None: `param_dtype`, as FSDP2)."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None

    def gather_dtype(self, shard_dtype: torch.dtype) -> torch.dtype:
        """The dtype a shard of `shard_dtype` is gathered in (a non-floating one: its own)."""
        return self.param_dtype if self.param_dtype and shard_dtype.is_floating_point else shard_dtype

    def reduce_in(self, shard_dtype: torch.dtype) -> torch.dtype:
        """The dtype the gradients of a shard of `shard_dtype` are reduce-scattered in."""
        return self.reduce_dtype or self.gather_dtype(shard_dtype)


@dataclass(frozen=True)
class MixedPrecision:
    """The parsed setting: a default policy and per-unit ones ((unit name or glob, policy), the first
    matching decides; a unit no entry matches takes the default)."""

    default: UnitPrecision = UnitPrecision()
    units: Tuple[Tuple[str, UnitPrecision], ...] = ()

    def for_unit(self, unit: str) -> UnitPrecision:
        return next((p for glob, p in self.units if fnmatch.fnmatchcase(unit, glob)), self.default)

    @property
    def active(self) -> bool:
        """Whether any unit is gathered or reduced in another dtype than its shard's (maybe)."""
        return any(p != UnitPrecision() for p in (self.default, *(p for _, p in self.units)))


def _dtype(where: str, value: Any) -> Optional[torch.dtype]:
    if value is None:
        return None
    name = value.replace("torch.", "") if isinstance(value, str) else None
    if name not in DTYPE_NAMES:
        raise ConfigError(f"pas_config[{KEY!r}]{where} is {value!r}: give a floating dtype by name, one of "
                          f"{', '.join(DTYPE_NAMES)} (or None: the shards' dtype)")
    return DTYPE_NAMES[name]


def _policy(where: str, setting: Any, base: UnitPrecision, allowed: Tuple[str, ...]) -> UnitPrecision:
    if not isinstance(setting, Mapping):
        raise ConfigError(f"pas_config[{KEY!r}]{where} is {setting!r}: give a mapping of "
                          f"{', '.join(allowed)} (e.g. {{'param_dtype': 'bfloat16', 'reduce_dtype': 'float32'}})")
    unknown = sorted(str(k) for k in setting if k not in allowed)
    if unknown:
        raise ConfigError(f"pas_config[{KEY!r}]{where} has unknown key(s) {', '.join(map(repr, unknown))}: the keys "
                          f"are {', '.join(allowed)} (FSDP2's MixedPrecisionPolicy names; buffers keep their dtype)")
    values = {f: _dtype(f"{where}[{f!r}]", setting[f]) if f in setting else getattr(base, f) for f in _FIELDS}
    return UnitPrecision(**values)


def mixed_precision(setting: Any, zero_stage: int = 3, inference_only: bool = False) -> MixedPrecision:
    """``pas_config["zero3_mixed_precision"]`` (None: no policy) as a `MixedPrecision`. Raises
    ConfigError naming the culprit for an unknown key or dtype name, or a policy without
    ``use_zero=3`` (only the fully sharded gathers cast: elsewhere the parameters are used as they
    are; cast the model, or use the Trainer's / Lightning's ``precision``)."""
    if setting is None or setting == {}:
        return MixedPrecision()
    default = _policy("", setting, UnitPrecision(), (*_FIELDS, "units"))
    units = setting.get("units") or {}
    if not isinstance(units, Mapping) or not all(isinstance(k, str) for k in units):
        raise ConfigError(f"pas_config[{KEY!r}]['units'] is {units!r}: give a mapping of unit names or globs "
                          f"(e.g. 'model.layers.*', 'lm_head', '' for the root) to {{'param_dtype': ..., "
                          f"'reduce_dtype': ...}}")
    out = MixedPrecision(default, tuple((glob, _policy(f"['units'][{glob!r}]", p, default, _FIELDS))
                                        for glob, p in units.items()))
    if out.active and (zero_stage != 3 or inference_only):
        raise ConfigError(f"pas_config[{KEY!r}] needs ComputeConfig(use_zero=3) for training: only the fully "
                          f"sharded parameters are gathered in param_dtype (this config has ZeRO stage "
                          f"{zero_stage}{' and inference_only=True' if inference_only else ''}); use the "
                          f"precision setting (the Trainer's / Lightning's precision, "
                          f"nnscaler.runtime.precision) instead")
    return out
