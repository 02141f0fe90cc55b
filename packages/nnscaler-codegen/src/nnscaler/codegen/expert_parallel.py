"""Expert parallelism in generated code: a routed-experts op split along its experts dim.

The `ep` policy splits each ``routed_experts`` op (``nnscaler.ir.ops.moe``) along ``e`` (its
`EXPERT_DIM`): piece i holds 1/n of the tokens and 1/n of the experts, which no annotation can say
(the index holds global expert ids). `expert_parallel_call` rewrites the op's statement
``y = nnscaler.ir.ops.moe.routed_experts(x, ...)`` to ``y = nr.moe.expert_parallel(x, ...,
ranks=(...))`` with the ranks of the unit, where the runtime exchanges the tokens by all-to-all.
"""
from __future__ import annotations

from typing import List

from nnscaler.ir import EXPERT_DIM, ROUTED_EXPERTS, Node

from .errors import GenerationError
from .layouts import UnitPlan

__all__ = ["expert_parallel_call", "is_expert_parallel", "RUNTIME_CALL"]

RUNTIME_CALL = "nr.moe.expert_parallel"


def is_expert_parallel(node: Node, unit: UnitPlan) -> bool:
    """A routed-experts op whose pieces split its experts over the unit."""
    return node.target == ROUTED_EXPERTS and bool(unit.partitioned.get(node.id)) and \
        node.pieces[0].dim == EXPERT_DIM


def expert_parallel_call(node: Node, lines: List[str], unit: UnitPlan, ranks: tuple) -> List[str]:
    """`lines` (the op's statement) calling the runtime's expert-parallel op over `ranks`."""
    if not is_expert_parallel(node, unit):
        return lines
    call = ROUTED_EXPERTS + "("
    if len(lines) != 1 or lines[0].count(call) != 1 or not lines[0].endswith(")"):
        raise GenerationError(f"expert parallelism: cannot rewrite the routed-experts op {node.describe()} "
                              f"(generated as {lines!r})")
    return [lines[0].replace(call, RUNTIME_CALL + "(")[:-1] + f", ranks={tuple(ranks)!r})"]
