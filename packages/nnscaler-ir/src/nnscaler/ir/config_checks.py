"""ComputeConfig settings that are valid but do nothing: said with a `ConfigWarning`.

A setting that silently has no effect is a wrong belief about the run (a user who sets
``zero_use_reduce_scatter`` without ``use_zero`` thinks ZeRO reduces the gradients; ``zero_ngroups``
without ``use_zero`` is refused outright by ComputeConfig). `parallelize()`
warns (once, on rank 0, at the user's call) for each one, naming the key and the fix.
"""
from __future__ import annotations

from typing import List

from .errors import NnScalerWarning
from .user_code import warn_user

__all__ = ["ConfigWarning", "ineffective_settings", "warn_ineffective_settings"]


class ConfigWarning(NnScalerWarning):
    """A ComputeConfig key whose value has no effect with the rest of the config."""


def ineffective_settings(cfg) -> List[str]:
    """One message per setting of ``cfg`` (a ComputeConfig) that has no effect, with the fix."""
    out = []
    dp = cfg.dp_size
    if not cfg.use_zero:  # (zero_ngroups > 1 without use_zero is refused by ComputeConfig itself)
        if cfg.zero_use_reduce_scatter:
            out.append("ComputeConfig.zero_use_reduce_scatter=True has no effect without use_zero=True (it "
                       "changes how ZeRO reduces gradients): set use_zero=True, or leave it False")
    elif dp == 1:
        what = "parameters, gradients and optimizer state" if cfg.zero_stage == 3 else "optimizer state"
        out.append(f"ComputeConfig.use_zero={cfg.use_zero!r} shards nothing: ZeRO shards the {what} across "
                   f"data-parallel replicas, and runtime_ngpus // plan_ngpus = {cfg.runtime_ngpus} // "
                   f"{cfg.plan_ngpus} = 1 (no replica). Use runtime_ngpus a multiple > 1 of plan_ngpus "
                   f"(e.g. runtime_ngpus={2 * cfg.plan_ngpus}), or set use_zero=False")
    elif cfg.zero_ngroups == dp:
        out.append(f"ComputeConfig.use_zero={cfg.use_zero!r} shards nothing: zero_ngroups={cfg.zero_ngroups} cuts the "
                   f"{dp} data-parallel replicas into groups of one rank, and each group holds a whole copy "
                   f"of the optimizer state. Use a smaller zero_ngroups (1 shards over all {dp} replicas), or "
                   f"set use_zero=False")
    return out


def warn_ineffective_settings(cfg) -> None:
    """Warn (`ConfigWarning`, at the user's call) for each setting of ``cfg`` that has no effect."""
    for message in ineffective_settings(cfg):
        warn_user(message, ConfigWarning)
