"""One plan's prediction (nnscaler.policies.estimate.plan_cost): memory with ZeRO and recomputation,
the stages, and how the step is put together, against hand-computed values."""
from __future__ import annotations

import dataclasses

import pytest

from nnscaler.policies.estimate import ModelSpec, Plan, Workload, costs, estimate_plan, load_cluster
from nnscaler.policies.estimate.plan_cost import gpu_layers, stage_layers

SPEC = ModelSpec(hidden=1024, layers=4, heads=16, kv_heads=16, head_dim=64, ffn=4096, vocab=32000, gated=True)


@pytest.fixture(scope="module")
def h100():
    return load_cluster("h100-sxm")


def test_analytic_parameter_count():
    layer = 1024 * 64 * (2 * 16 + 2 * 16) + 3 * 1024 * 4096 + 2 * 1024
    assert SPEC.layer_params == layer == 16_779_264
    assert SPEC.total_params == 4 * layer + 2 * 32000 * 1024 + 1024
    assert dataclasses.replace(SPEC, tied=True).total_params == 4 * layer + 32000 * 1024 + 1024


def test_stage_layers():
    assert stage_layers(126, 16) == [7] + [8] * 14 + [7]  # Llama 3 405B: the ends hold the embedding and head
    assert sum(stage_layers(105, 35)) == 105 and set(stage_layers(105, 35)) == {3}
    assert gpu_layers(10, 2, 2) == [5, 5]  # stages [2, 3, 3, 2]: GPU 0 holds 0 and 2, GPU 1 holds 1 and 3


def test_memory_with_zero(h100):
    work = Workload(gpus=4, seq=1024, global_batch_tokens=4 * 1024)
    p = SPEC.total_params
    plain = estimate_plan(SPEC, h100, work, Plan(1, 1, 4, 0, 1, False))
    zero = estimate_plan(SPEC, h100, work, Plan(1, 1, 4, 1, 1, False))
    assert plain.memory_parts["weights"] == pytest.approx(2 * p)
    assert plain.memory_parts["gradients"] == pytest.approx(2 * p)
    assert plain.memory_parts["optimizer"] == pytest.approx(12 * p)  # fp32 master, m, v
    assert zero.memory_parts["optimizer"] == pytest.approx(12 * p / 4)  # sharded over dp = 4
    assert plain.memory_bytes - zero.memory_bytes == pytest.approx(12 * p * 3 / 4)


def test_activation_memory_and_recompute(h100):
    work = Workload(gpus=1, seq=1024, global_batch_tokens=1024)
    per_layer = 1024 * (4 * 1024 + 64 * 64 + 4 * 4096) * 2  # tokens x kept elements x bf16
    kept = estimate_plan(SPEC, h100, work, Plan(1, 1, 1, 0, 1, False))
    rc = estimate_plan(SPEC, h100, work, Plan(1, 1, 1, 0, 1, True))
    assert kept.memory_parts["activations"] == pytest.approx(4 * per_layer)
    assert rc.memory_parts["activations"] == pytest.approx(4 * 1024 * 1024 * 2 + per_layer)  # inputs + one layer
    assert rc.compute_s > kept.compute_s  # the recomputed forward


def test_tensor_parallel_divides_activations_and_pays_communication(h100):
    work = Workload(gpus=2, seq=1024, global_batch_tokens=1024)
    tp2 = estimate_plan(SPEC, h100, work, Plan(2, 1, 1, 0, 1, False))
    tp1 = estimate_plan(SPEC, h100, Workload(gpus=1, seq=1024, global_batch_tokens=1024), Plan(1, 1, 1, 0, 1, False))
    assert tp2.memory_parts["activations"] == pytest.approx(tp1.memory_parts["activations"] / 2)
    # 4 layers x 2 passes x 2 all-reduces of b·s·h bf16 over 2 GPUs inside the node
    one = costs.ring_all_reduce_time(1024 * 1024 * 2, 2, h100.intra_node)
    assert tp2.tp_comm_s == pytest.approx(4 * 2 * 2 * one)
    assert tp1.tp_comm_s == 0.0


def test_pipeline_bubble_and_step(h100):
    work = Workload(gpus=2, seq=1024, global_batch_tokens=8 * 1024)
    est = estimate_plan(SPEC, h100, work, Plan(1, 2, 1, 0, 1, False))
    assert est.nmicros == 8
    per_micro = (est.compute_s + est.tp_comm_s + est.pp_comm_s) / 8
    assert est.bubble_s == pytest.approx(per_micro)  # (pp - 1) micro-batches
    assert est.bubble_s / (est.bubble_s + 8 * per_micro) == pytest.approx(costs.bubble_fraction(2, 8))
    assert est.step_s == pytest.approx(est.compute_s + est.bubble_s + est.comm_s + est.optimizer_s)
    assert est.mfu == pytest.approx(costs.mfu(est.model_flops, est.step_s, 2, 989e12))


def test_data_parallel_across_nodes_uses_the_network(h100):
    work = Workload(gpus=16, seq=1024, global_batch_tokens=16 * 1024)
    inside = estimate_plan(SPEC, h100, Workload(gpus=8, seq=1024, global_batch_tokens=8 * 1024),
                           Plan(1, 1, 8, 0, 1, False))
    across = estimate_plan(SPEC, h100, work, Plan(1, 1, 16, 0, 1, False))
    assert across.dp_comm_s > inside.dp_comm_s
