"""`data`: tensor parallelism on the batch dimension inside a unit.

Every op whose first tensor input's leading dim is splittable (and divides evenly) is split
along it over the unit's devices; other ops (the batch-mean loss, shape ops) are replicated.
"""
from __future__ import annotations

from ..registry import register_policy
from ._nothing_split import warn_if_nothing_split
from ._spread import split_batch_or_replicate


@register_policy("data", keys=())
def data(graph, compute_config):
    devices = list(range(compute_config.plan_ngpus))
    for node in graph.nodes:
        split_batch_or_replicate(graph, node, devices)
    warn_if_nothing_split(graph, "data", len(devices))
    return graph
