"""nnscaler.policies: PAS primitives (select, partition, replicate, assign) and built-in policies by name."""
