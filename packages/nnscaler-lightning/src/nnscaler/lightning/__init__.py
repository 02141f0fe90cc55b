"""nnscaler.lightning: nnscaler as a Lightning strategy (docs/lightning.md).

- `NnScalerStrategy`: `Trainer(strategy=NnScalerStrategy(compute_config=..., pas_policy=...))`, or
  `Trainer(strategy="nnscaler", devices=N)` (data parallel over all devices); importing this
  package registers "nnscaler", "nnscaler_spawn" and "nnscaler_fork" in Lightning's registry.
- `NnScalerPrecision`: its precision plugin (32-true, bf16 / fp16 mixed and true; fp16 with a grad
  scaler whose overflow check spans the ranks; gradient clipping by norm across ranks).
- `fabric.NnScalerStrategy`: the same for Lightning Fabric (`Fabric(strategy="nnscaler")`; this
  import registers it in Fabric's registry too).
- `NnScalerLightningError`: every deliberate refusal (an `nnscaler.ir.NnScalerError`).
"""
from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry

from .errors import NnScalerLightningError
from .precision import NnScalerPrecision
from .strategy import NnScalerStrategy

NnScalerStrategy.register_strategies(_StrategyRegistry)

from . import fabric  # noqa: E402 - registers "nnscaler" for Fabric

__all__ = ["NnScalerStrategy", "NnScalerPrecision", "NnScalerLightningError", "fabric"]
