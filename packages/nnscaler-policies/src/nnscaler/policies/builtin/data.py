"""`data`: tensor parallelism on the batch dimension inside a unit.

Every op whose first tensor input's leading dim is splittable (and divides evenly) is split
along it over the unit's devices; other ops (the batch-mean loss, shape ops) are replicated.
"""
from __future__ import annotations

from ..plan import tensor_inputs
from ..registry import register_policy
from ._spread import dim_of_input_axis, replicate_over_unit, split_over_unit, splittable


@register_policy("data")
def data(graph, compute_config):
    n = compute_config.plan_ngpus
    for node in graph.nodes:
        batch = dim_of_input_axis(graph, node, 0, 0) if tensor_inputs(graph, node) and n > 1 else None
        if batch is not None and batch in splittable(graph, node, n):
            split_over_unit(graph, node, batch, n)
        else:
            replicate_over_unit(graph, node, n)
    return graph
