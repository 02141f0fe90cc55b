"""Policy primitives on a real traced graph: select, replicate, partition, assign, validation."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler.ir import ComputeConfig, trace
from nnscaler.ir.layout import Partial, Replicate, Shard
from nnscaler.policies import (PlanError, apply_policy, assign, available_policies, get_policy, partition,
                               replicate, select, validate_plan)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.logcumsumexp(F.relu(self.fc1(x)), dim=-1)
        return self.fc2(h).sum()


@pytest.fixture
def graph():
    return trace(Net(), {"x": torch.randn(6, 8)}, trace_strategy="cpu")


def test_select_filters_by_op_module_and_plan_state(graph):
    assert [n.module_path for n in select(graph, op="linear")] == ["fc1", "fc2"]
    assert [n.short_name for n in select(graph, module="fc2")] == ["linear"]
    assert select(graph, op="torch.nn.functional.*")[0].target == "torch.nn.functional.linear"
    assert [n.short_name for n in select(graph, where=lambda n: n.annotation is None)] == ["logcumsumexp"]
    replicate(graph, graph.nodes[0], 1)
    assert graph.nodes[0] not in select(graph, unplanned=True)


def test_partition_follows_the_annotation(graph):
    fc1 = select(graph, module="fc1")[0]
    pieces = partition(graph, fc1, "n", 2)  # output features: weight rows split, input replicated
    assert len(pieces) == 2
    assert pieces[0].inputs[0] == Replicate() and pieces[0].inputs[1] == Shard(0)
    assert pieces[0].outputs == [Shard(1)]
    k_pieces = partition(graph, select(graph, module="fc2")[0], "k", 2)  # reduced dim -> value split
    assert k_pieces[1].outputs == [Partial()]
    assert not k_pieces[1].is_replicated()


def test_partition_errors_name_the_op(graph):
    unannotated = select(graph, op="logcumsumexp")[0]
    with pytest.raises(PlanError, match="logcumsumexp.*no dimension annotation"):
        partition(graph, unannotated, "d", 2)
    fc1 = select(graph, module="fc1")[0]
    with pytest.raises(PlanError, match="along 'zz'"):
        partition(graph, fc1, "zz", 2)
    with pytest.raises(PlanError, match="into 3"):
        partition(graph, fc1, "n", 3)  # 16 output features are not divisible by 3
    with pytest.raises(PlanError, match="positive int"):
        replicate(graph, fc1, 0)


def test_assign_and_validate(graph):
    with pytest.raises(PlanError, match="has no pieces yet"):
        assign(graph.nodes[0], 0)
    with pytest.raises(PlanError, match="without a plan"):
        validate_plan(graph, 1, "mine")
    with pytest.raises(PlanError, match="non-negative int"):
        assign(replicate(graph, graph.nodes[0], 1)[0], -1)
    for node in graph.nodes:
        replicate(graph, node, 1)
    with pytest.raises(PlanError, match="did not assign"):
        validate_plan(graph, 1, "mine")
    for node in graph.nodes:
        assign(node, 1)
    with pytest.raises(PlanError, match="plan_ngpus is 1"):
        validate_plan(graph, 1, "mine")
    for node in graph.nodes:
        assign(node, 0)
    validate_plan(graph, 1, "mine")


def test_registry_by_name_callable_and_dotted_path(graph):
    assert {"dp", "tp", "data", "megatron", "pp", "hybrid", "autodist"} <= set(available_policies())
    assert get_policy("dp") is get_policy("nnscaler.policies.builtin.dp.dp")
    fn = lambda g, c: g  # noqa: E731
    assert get_policy(fn) is fn
    with pytest.raises(ValueError, match="unknown pas_policy .tq.; built-in policies: autodist, cp, data, dp, ep, hybrid, megatron, pp, tp"):
        get_policy("tq")
    with pytest.raises(ValueError, match="cannot import pas_policy"):
        get_policy("no.such.module.policy")
    with pytest.raises(TypeError, match="policy name or a callable"):
        get_policy(3)


def test_dp_policy_replicates_everything_on_device_0(graph):
    planned = apply_policy(graph, ComputeConfig(1, 4), "dp")
    assert all(len(n.pieces) == 1 and n.pieces[0].device == 0 and n.pieces[0].is_replicated()
               for n in planned.nodes)
    with pytest.raises(PlanError, match="needs plan_ngpus == 1"):
        apply_policy(graph, ComputeConfig(2, 4), "dp")


def test_policy_returning_none_keeps_the_graph(graph):
    def in_place(g, cfg):
        for node in g.nodes:
            assign(replicate(g, node, 1)[0], 0)

    assert apply_policy(graph, ComputeConfig(1, 1), in_place) is graph


def test_partition_error_names_the_users_line_and_the_splittable_dims(graph):
    fc1 = select(graph, module="fc1")[0]
    with pytest.raises(PlanError) as info:
        partition(graph, fc1, "zz", 2)
    message = str(info.value)
    assert "(module fc1)" in message and f"{__file__}:" in message and "h = torch.logcumsumexp" in message
    assert "Dims it can split into 2: " in message and "n" in message.split("Dims it can split into 2: ")[1]


def test_tp_data_and_megatron_cover_the_unit(graph):
    for name in ("tp", "data", "megatron"):
        planned = apply_policy(graph, ComputeConfig(2, 4), name)
        for node in planned.nodes:
            assert sorted(p.device for p in node.pieces) == [0, 1], (name, node.describe())
    planned = apply_policy(graph, ComputeConfig(2, 2), "data")
    fc1 = select(planned, module="fc1")[0]
    assert fc1.pieces[0].dim == "b0" and fc1.pieces[0].inputs[0] == Shard(0)
