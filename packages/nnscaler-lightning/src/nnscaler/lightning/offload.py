"""Optimizer offload (``NnScalerStrategy(cpu_offload=True)``): the runtime's `offload_optimizer`
(nnscaler.runtime, offload.py there), re-exported so that ``nnscaler.lightning.offload`` keeps
working. The strategies call it with ``device="cpu"`` (`sharded_args.OFFLOAD_DEVICE`)."""
from __future__ import annotations

from nnscaler.runtime import OffloadedOptimizer, offload_optimizer, step_gradients

__all__ = ["OffloadedOptimizer", "offload_optimizer", "step_gradients"]
