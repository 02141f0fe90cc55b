"""nnscaler.lightning.fabric: `NnScalerStrategy` for Lightning Fabric (docs/lightning.md).
Importing it registers ``strategy="nnscaler"`` in Fabric's strategy registry."""
from lightning.fabric.strategies import STRATEGY_REGISTRY as _REGISTRY

from .precision import NnScalerPrecision
from .strategy import NnScalerStrategy

NnScalerStrategy.register_strategies(_REGISTRY)

__all__ = ["NnScalerStrategy", "NnScalerPrecision"]
