"""nnscaler.lightning: NnScalerStrategy, NnScalerPrecision and a Fabric strategy."""
