"""nnscaler.runtime.comm: the collectives generated code calls as ``nr.comm.<name>(x, ..., ranks=...)``.

Layout transitions as autograd functions (forward collective, dual collective in backward):
`split`, `all_gather`, `all_reduce`, `reduce_scatter`, `all_to_all`, `to_partial`,
`shard_to_partial`, `grad_all_reduce`, `all_gather_rs`, `all_reduce_ar` (see `collectives`).
Per-rank counters, off by default: `CommStats`, `enable_stats`, `disable_stats`, `reset_stats`,
`stats_snapshot`, `count_collectives`, `record` (see `stats` for the bytes convention).
Backend gaps and their fallbacks: `fallback_plan`, `force_fallback` (see `fallbacks`).
"""
from .collectives import (
    TRANSITIONS, all_gather, all_gather_rs, all_reduce, all_reduce_ar, all_to_all, grad_all_reduce,
    reduce_scatter, shard_to_partial, split, to_partial)
from .fallbacks import fallback_plan, force_fallback
from .primitives import CommError, UnevenSplitError, group_for
from .stats import (
    CommStats, count_collectives, disable_stats, enable_stats, global_stats, record, reset_stats,
    stats_enabled, stats_snapshot)

__all__ = [
    "CommError", "CommStats", "TRANSITIONS", "UnevenSplitError", "all_gather", "all_gather_rs",
    "all_reduce", "all_reduce_ar", "all_to_all", "count_collectives", "disable_stats", "enable_stats",
    "fallback_plan", "force_fallback", "global_stats", "grad_all_reduce", "group_for", "record",
    "reduce_scatter", "reset_stats", "shard_to_partial", "split", "stats_enabled", "stats_snapshot",
    "to_partial",
]
