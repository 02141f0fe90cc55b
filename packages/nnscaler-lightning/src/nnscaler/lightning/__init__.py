"""nnscaler.lightning: NnScalerStrategy, NnScalerPrecision and a Fabric strategy.

Skeleton: this package has no code yet and exports nothing. It will hold ``NnScalerStrategy``
(a Lightning strategy that parallelizes the LightningModule with nnscaler and saves sharded or
deduped checkpoints), ``NnScalerPrecision`` (32-true, 16-true, bf16-true, 16-mixed, bf16-mixed)
and a Fabric strategy. See the package README.
"""
