"""FSDPStrategy's ``mixed_precision`` argument in nnscaler's terms: torch's
``torch.distributed.fsdp.MixedPrecision`` (what Lightning's FSDPStrategy takes), FSDP2's
``MixedPrecisionPolicy``, or the mapping ``pas_config["zero3_mixed_precision"]`` takes ->
that ``pas_config`` entry (``use_zero=3``'s units gathered and computed in ``param_dtype`` from
their shards, gradients reduce-scattered in ``reduce_dtype``; `nnscaler.ir.contracts.mixed_precision`).

Taken: ``param_dtype``, ``reduce_dtype``; the floating inputs of each unit are cast to its
``param_dtype`` (FSDP2's ``cast_forward_inputs=True``), whatever ``cast_forward_inputs`` says.
Refused, naming the field: ``buffer_dtype`` (buffers keep their dtype: cast them with the
Trainer's ``precision``), ``keep_low_precision_grads``, ``output_dtype``. FSDP1's
``_module_classes_to_ignore`` (batch norms kept in fp32) is not applied: per-unit policies do that
(``pas_config["zero3_mixed_precision"]["units"]``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from nnscaler.ir import ComputeConfig, ConfigError
from nnscaler.ir.contracts import mixed_precision

from .errors import NnScalerLightningError

__all__ = ["mixed_precision_setting", "mixed_precision_config"]

_UNSUPPORTED = {"buffer_dtype": None, "keep_low_precision_grads": False, "output_dtype": None}


def _name(dtype: Any) -> Any:
    return str(dtype).replace("torch.", "") if dtype is not None and not isinstance(dtype, str) else dtype


def mixed_precision_setting(policy: Any, argument: str = "mixed_precision") -> Optional[dict]:
    """``pas_config["zero3_mixed_precision"]`` for FSDP's `policy` (None: none); checked."""
    if policy is None:
        return None
    if isinstance(policy, dict):
        setting = dict(policy)
    elif dataclasses.is_dataclass(policy) and hasattr(policy, "param_dtype"):
        for field, default in _UNSUPPORTED.items():
            value = getattr(policy, field, default)
            if value != default:
                raise NnScalerLightningError(
                    f"NnScalerStrategy({argument}=...{type(policy).__name__}({field}={value!r})): not supported; "
                    f"use_zero=3 takes param_dtype and reduce_dtype (buffers keep their dtype: cast them with the "
                    f"Trainer's precision)")
        setting = {k: _name(getattr(policy, k)) for k in ("param_dtype", "reduce_dtype")
                   if getattr(policy, k) is not None}
    else:
        raise NnScalerLightningError(
            f"NnScalerStrategy({argument}={policy!r}): give torch.distributed.fsdp.MixedPrecision, FSDP2's "
            f"MixedPrecisionPolicy, or a mapping as pas_config['zero3_mixed_precision'] "
            f"({{'param_dtype': 'bfloat16', 'reduce_dtype': 'float32'}})")
    try:
        mixed_precision(setting)  # names, keys (use_zero=3: at setup, where the config is known)
    except ConfigError as e:
        raise NnScalerLightningError(f"NnScalerStrategy({argument}=...): {e}") from None
    return setting


def mixed_precision_config(cfg: ComputeConfig, setting: Optional[dict], argument: str = "mixed_precision"
                           ) -> ComputeConfig:
    """`cfg` with `setting` as ``pas_config["zero3_mixed_precision"]``; refused without use_zero=3 or
    when the compute_config already has another one."""
    if setting is None:
        return cfg
    given = cfg.pas_config.get("zero3_mixed_precision")
    if given is not None and given != setting:
        raise NnScalerLightningError(
            f"NnScalerStrategy({argument}=...) gives {setting!r} but compute_config.pas_config"
            f"['zero3_mixed_precision'] is {given!r}: give one of the two")
    if cfg.zero_stage != 3:
        raise NnScalerLightningError(
            f"NnScalerStrategy({argument}=...) needs the fully sharded plan: sharding_strategy='FULL_SHARD' (or "
            f"'HYBRID_SHARD', or compute_config use_zero=3); this plan has use_zero={cfg.use_zero!r}. Without "
            f"sharding, use the Trainer's precision ('bf16-mixed', 'bf16-true')")
    return dataclasses.replace(cfg, pas_config={**cfg.pas_config, "zero3_mixed_precision": setting})
