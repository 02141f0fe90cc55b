"""codegen/collective_ops.py: a routed-experts op split along its experts dim and attention split
along the ring dim become calls of the runtime's versions with the unit's ranks (expert parallelism also with its
layer's name); nothing else is rewritten."""
from __future__ import annotations

import pytest

from nnscaler.codegen.errors import GenerationError
from nnscaler.codegen.collective_ops import collective_call, runtime_call
from nnscaler.codegen.layouts import UnitPlan
from nnscaler.ir import Node, Shard
from nnscaler.ir.contracts import Piece
from nnscaler.ir import EXPERT_DIM, RING_DIM, ROUTED_EXPERTS, SDPA

LINE = "y = nnscaler.ir.ops.moe.routed_experts(x, idx, w, self.up, self.down, activation='silu')"


def _node(dim, target=ROUTED_EXPERTS):
    node = Node(7, target, [], {}, None)
    node.pieces = [Piece(i, 2, [Shard(0)] * 5, [Shard(0)], dim, i) for i in range(2)]
    return node


def test_split_experts_call_the_runtime_over_the_unit():
    unit = UnitPlan(2, partitioned={7: True})
    assert runtime_call(_node(EXPERT_DIM), unit) == "nr.moe.expert_parallel"
    assert collective_call(_node(EXPERT_DIM), [LINE], unit, (2, 3)) == [
        "y = nr.moe.expert_parallel(x, idx, w, self.up, self.down, activation='silu', ranks=(2, 3), layer='op 7')"]
    node = _node(EXPERT_DIM)
    node.module_path = "model.layers.1.mlp.experts"  # the layer's key in the expert-load record
    assert collective_call(node, [LINE], unit, (0, 1))[0].endswith(", ranks=(0, 1), layer='model.layers.1.mlp.experts')")


def test_token_split_and_replicated_ops_stay():
    assert collective_call(_node("t"), [LINE], UnitPlan(2, partitioned={7: True}), (0, 1)) == [LINE]
    assert collective_call(_node(EXPERT_DIM), [LINE], UnitPlan(2, partitioned={7: False}), (0, 1)) == [LINE]


def test_an_unexpected_statement_is_refused():
    with pytest.raises(GenerationError, match="cannot rewrite the op .* to nr.moe.expert_parallel"):
        collective_call(_node(EXPERT_DIM), [LINE, "z = y"], UnitPlan(2, partitioned={7: True}), (0, 1))


def test_ring_split_attention_calls_ring_attention():
    line = "o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True)"
    unit = UnitPlan(2, partitioned={7: True})
    assert collective_call(_node(RING_DIM, SDPA), [line], unit, (0, 1)) == [
        "o = nr.ring_attention.attention(q, k, v, attn_mask=None, is_causal=True, ranks=(0, 1))"]
    assert collective_call(_node("h", SDPA), [line], unit, (0, 1)) == [line]  # split by heads: as traced
