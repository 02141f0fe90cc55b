"""The built-in `tp` and `data` policies say so when they split no op at all (`PolicyWarning`).

Over ``plan_ngpus > 1`` devices such a plan runs the whole model on every device of a unit: the
devices do the same work, and the user who asked for tensor parallelism does not get it. The
warning names the policy, why nothing could be split and what to change. (How much of a plan is
replicated in general is the plan report's business: `nnscaler.runtime.PlanWarning`.)
"""
from __future__ import annotations

from typing import List

from nnscaler.ir import NnScalerWarning
from nnscaler.ir import warn_user

from ..plan import tensor_inputs

__all__ = ["PolicyWarning", "warn_if_nothing_split"]


class PolicyWarning(NnScalerWarning):
    """A built-in policy that could not partition anything of the model it was given."""


def warn_if_nothing_split(graph, policy: str, n: int) -> None:
    """Warn when no op of `graph` has pieces split along a dim (call after the policy ran)."""
    if n <= 1 or any(p.dim is not None for node in graph.nodes for p in node.pieces or ()):
        return
    model = graph.module_class
    if policy == "data":
        sizes = sorted({graph.value(ref).shape[0] for inp in graph.inputs for _, ref in inp.leaves
                        if graph.value(ref).is_tensor and graph.value(ref).shape})
        why = (f"the batch dim (the leading dim of the inputs: size {', '.join(map(str, sizes))} when traced) "
               f"is not divisible by plan_ngpus={n}" if sizes and all(s % n for s in sizes) else
               "no op's first input has an annotated leading dim that splits evenly")
        fix = (f"trace and train with a batch size that is a multiple of {n}, or use the 'dp' policy "
               f"(plan_ngpus=1) for data parallelism")
    else:
        annotated = [nd for nd in graph.nodes if nd.annotation is not None and tensor_inputs(graph, nd)]
        bare = _names([nd for nd in graph.nodes if nd.annotation is None and tensor_inputs(graph, nd)])
        why = (f"none of its {len(annotated)} annotated op(s) has a dim whose size is divisible by {n}"
               + (f", and {len(bare)} op kind(s) have no annotation ({', '.join(bare[:5])})" if bare else ""))
        fix = (f"use sizes divisible by {n}, register annotations for custom ops (nnscaler.register_op), "
               f"or use the 'dp' policy (plan_ngpus=1)")
    warn_user(f"policy {policy!r} split no op of {model} over plan_ngpus={n}: {why}. Every device of a unit "
              f"runs the whole model, so the {n} devices do the same work. To parallelize, {fix}",
              PolicyWarning)


def _names(nodes) -> List[str]:
    return list(dict.fromkeys(nd.target for nd in nodes))
