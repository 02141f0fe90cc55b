"""nnscaler.ir: Tracing into the IR: ComputeConfig, IRGraph, trace(), the op registry with dimension annotations, register_op."""
