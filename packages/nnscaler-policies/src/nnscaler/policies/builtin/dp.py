"""`dp`: pure data parallelism. Every op runs whole on the single plan device; the runtime
replicates the model over runtime_ngpus ranks and all-reduces gradients."""
from __future__ import annotations

from ..plan import PlanError
from ..primitives import assign, replicate
from ..registry import register_policy


@register_policy("dp", keys=())
def dp(graph, compute_config):
    if compute_config.plan_ngpus != 1:
        raise PlanError(f"the 'dp' policy needs plan_ngpus == 1 (data parallelism only), got "
                        f"plan_ngpus={compute_config.plan_ngpus}; use plan_ngpus=1 and "
                        f"runtime_ngpus=<number of processes>")
    for node in graph.nodes:
        assign(replicate(graph, node, 1)[0], 0)
    return graph
