"""nnscaler.runtime: What generated code imports: ParallelModule, reducer, process groups; parallelize() and build_optimizer()."""
