"""`tp`: tensor parallelism inside a unit, data parallelism across units.

Every annotated op is split over the `plan_ngpus` devices of the unit along one of the dims it
can split evenly, chosen at random with `pas_config['seed']` (default 1); other ops are
replicated. The adapters make any choice correct; the seed only changes the communication. An
in-place write through a view (``buf[..., :8].copy_(x)``), its views and their base stay
replicated (`written_through_views`): an adapter between them would write into a copy.
"""
from __future__ import annotations

import random

from ..registry import register_policy
from ._nothing_split import warn_if_nothing_split
from ._spread import replicate_over_unit, split_over_unit, splittable, written_through_views


@register_policy("tp", keys=("seed",))
def tp(graph, compute_config):
    n = compute_config.plan_ngpus
    rng = random.Random(compute_config.pas_config.get("seed", 1))
    pinned = written_through_views(graph) if n > 1 else set()
    for node in graph.nodes:
        dims = splittable(graph, node, n) if n > 1 else []
        dim = rng.choice(sorted(dims)) if dims else None  # drawn for pinned ops too: the others' draws stay
        if dim is not None and node.id not in pinned:
            split_over_unit(graph, node, dim, n)
        else:
            replicate_over_unit(graph, node, n)
    warn_if_nothing_split(graph, "tp", n)
    return graph
