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


# -- ZeRO-3 (ComputeConfig(use_zero=3)): parameters, gradients and optimizer state sharded --------
def test_zero3_shards_weights_gradients_and_optimizer(h100):
    work = Workload(gpus=4, seq=1024, global_batch_tokens=4 * 1024)  # one micro-batch a step
    p = SPEC.total_params
    zero1 = estimate_plan(SPEC, h100, work, Plan(1, 1, 4, 1, 1, False))
    zero3 = estimate_plan(SPEC, h100, work, Plan(1, 1, 4, 3, 1, False))
    assert zero3.memory_parts["weights"] == pytest.approx(2 * p / 4)
    assert zero3.memory_parts["gradients"] == pytest.approx(2 * p / 4)
    assert zero3.memory_parts["optimizer"] == pytest.approx(12 * p / 4)
    assert zero1.memory_parts["optimizer"] == pytest.approx(12 * p / 4)
    # gathered at once: the root unit (embedding and head) and two decoder layers, with their gradients
    root = 2 * SPEC.vocab * SPEC.hidden
    assert zero3.memory_parts["gathered"] == pytest.approx(2 * 2 * (root + 2 * SPEC.layer_params), rel=1e-3)
    assert zero1.memory_parts["gathered"] == 0.0
    assert zero3.memory_bytes < zero1.memory_bytes


def test_zero3_accumulating_micro_batches_keeps_full_gradients(h100):
    """The Trainer accumulates under no_sync: the units' full gradients wait for the last micro-batch."""
    work = Workload(gpus=4, seq=1024, global_batch_tokens=16 * 1024)  # 4 micro-batches of 1
    p = SPEC.total_params
    zero3 = estimate_plan(SPEC, h100, work, Plan(1, 1, 4, 3, 1, False))
    assert zero3.nmicros == 4
    assert zero3.memory_parts["gradients"] == pytest.approx(2 * p / 4 + 2 * p)


def test_zero3_traffic_exposes_backward_gathers_and_reduce_scatters_once(h100):
    from nnscaler.policies.estimate.plan_cost import zero_sync_times
    grads = 1e9
    for nmicros in (1, 4):
        plain = zero_sync_times(grads, Plan(1, 1, 4, 0, 1, False), nmicros, h100)
        one = zero_sync_times(grads, Plan(1, 1, 4, 1, 1, False), nmicros, h100)
        three = zero_sync_times(grads, Plan(1, 1, 4, 3, 1, False), nmicros, h100)
        ag = costs.ring_all_gather_time(grads, 4, h100.intra_node)
        assert plain == (pytest.approx(costs.ring_all_reduce_time(grads, 4, h100.intra_node)), 0.0)
        assert one == (pytest.approx(ag), pytest.approx(ag))  # reduce-scatter; the gather after the step
        # exposed: one pass of gathers a micro-batch (the runtime prefetches in forward and backward)
        assert three == (pytest.approx(ag), pytest.approx(nmicros * ag))
        assert sum(three) >= sum(one) and (nmicros == 1 or sum(three) > sum(one))


def test_zero3_link_and_groups(h100):
    """A zero group spanning nodes uses the inter-node link; zero_ngroups keeps it inside a node and adds
    the all-reduce of the shard across the groups."""
    from nnscaler.policies.estimate.plan_cost import zero_sync_times
    grads = 1e9
    across = zero_sync_times(grads, Plan(1, 1, 16, 3, 1, False), 1, h100)
    assert across[1] == pytest.approx(costs.ring_all_gather_time(grads, 16, h100.inter_node))
    grouped = zero_sync_times(grads, Plan(1, 1, 16, 3, 1, False, zero_ngroups=2), 1, h100)
    assert grouped[1] == pytest.approx(costs.ring_all_gather_time(grads, 8, h100.intra_node))
    assert grouped[0] == pytest.approx(costs.ring_all_gather_time(grads, 8, h100.intra_node)
                                       + costs.ring_all_reduce_time(grads / 8, 2, h100.inter_node))


@pytest.mark.parametrize("kwargs, words", [
    (dict(tp=1, pp=1, dp=2, zero=2, micro_batch=1, recompute=False), "must be one of (0, 1, 3)"),
    (dict(tp=1, pp=1, dp=4, zero=3, micro_batch=1, recompute=False, zero_ngroups=3), "must divide dp"),
])
def test_zero_plans_refused_name_the_fix(kwargs, words):
    from nnscaler.ir import ConfigError
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Plan(**kwargs)
