"""codegen/expert_parallel.py: a routed-experts op split along its experts dim becomes a call of
the runtime's expert-parallel op with the unit's ranks; nothing else is rewritten."""
from __future__ import annotations

import pytest

from nnscaler.codegen.errors import GenerationError
from nnscaler.codegen.expert_parallel import expert_parallel_call, is_expert_parallel
from nnscaler.codegen.layouts import UnitPlan
from nnscaler.ir import Node, Shard
from nnscaler.ir.contracts import Piece
from nnscaler.ir.ops.moe import EXPERT_DIM, ROUTED_EXPERTS

LINE = "y = nnscaler.ir.ops.moe.routed_experts(x, idx, w, self.up, self.down, activation='silu')"


def _node(dim):
    node = Node(7, ROUTED_EXPERTS, [], {}, None)
    node.pieces = [Piece(i, 2, [Shard(0)] * 5, [Shard(0)], dim, i) for i in range(2)]
    return node


def test_split_experts_call_the_runtime_over_the_unit():
    unit = UnitPlan(2, partitioned={7: True})
    assert is_expert_parallel(_node(EXPERT_DIM), unit)
    assert expert_parallel_call(_node(EXPERT_DIM), [LINE], unit, (2, 3)) == [
        "y = nr.moe.expert_parallel(x, idx, w, self.up, self.down, activation='silu', ranks=(2, 3))"]


def test_token_split_and_replicated_ops_stay():
    assert expert_parallel_call(_node("t"), [LINE], UnitPlan(2, partitioned={7: True}), (0, 1)) == [LINE]
    assert expert_parallel_call(_node(EXPERT_DIM), [LINE], UnitPlan(2, partitioned={7: False}), (0, 1)) == [LINE]


def test_an_unexpected_statement_is_refused():
    with pytest.raises(GenerationError, match="cannot rewrite the routed-experts op"):
        expert_parallel_call(_node(EXPERT_DIM), [LINE, "z = y"], UnitPlan(2, partitioned={7: True}), (0, 1))
