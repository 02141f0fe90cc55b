"""autodist under ComputeConfig(use_zero=3) (fully sharded): the config takes the stage, the cost model
shards parameters and gradients as well as the optimizer state, counts the units gathered at once,
prices the gathers (twice a micro-batch) and the reduce-scatter (once a step), and a memory limit that
ZeRO-1 cannot meet is met (nnscaler.policies.autodist.config, cost_model, policy)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from nnscaler.ir import ComputeConfig, trace
from nnscaler.policies import apply_policy
from nnscaler.policies.autodist import AutodistConfig
from nnscaler.policies.autodist.comm_model import CommModel
from nnscaler.policies.autodist.cost_model import _Pricer, gathered_bytes
from nnscaler.policies.autodist.spmd_solver import NoPlanFits

LINE = {c: {"2": [1e-4, 1e9], "4": [1e-4, 1e9]}
        for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}
COMM = {"backend": "given", "collectives": LINE}


def cfg_of(use_zero, runtime=4, **pas):
    return AutodistConfig.from_compute_config(ComputeConfig(1, runtime, use_zero=use_zero, pas_config=pas))


@pytest.mark.parametrize("use_zero, stage, group", [(False, 0, 1), (True, 1, 4), (1, 1, 4), (3, 3, 4)])
def test_config_takes_the_zero_stage(use_zero, stage, group):
    cfg = cfg_of(use_zero)
    assert cfg.zero_stage == stage and cfg.zero_group == group


def test_zero_groups_divide_the_shard():
    cfg = AutodistConfig.from_compute_config(ComputeConfig(1, 8, use_zero=3, zero_ngroups=2))
    assert cfg.zero_stage == 3 and cfg.zero_group == 4


def _pricer(use_zero, update_freq=1):
    cfg = cfg_of(use_zero, update_freq=update_freq)
    return _Pricer(None, 1, CommModel(COMM), cfg, trainable_bytes=4e6)


def test_zero3_shards_parameters_gradients_and_optimizer():
    numel = 1e6
    size = 4 * numel  # fp32
    none, one, three = (_pricer(z).param_state(size, numel, True) for z in (False, True, 3))
    assert none == pytest.approx(2 * size + 8 * numel)  # weight, gradient, Adam's two states
    assert one == pytest.approx(2 * size + 8 * numel / 4)
    assert three == pytest.approx((2 * size + 8 * numel) / 4)
    assert three < one < none
    # accumulating micro-batches (the Trainer's no_sync) keeps the full gradient until the last one
    assert _pricer(3, update_freq=2).param_state(size, numel, True) == pytest.approx(three + size)
    assert _pricer(3).param_state(size, numel, False) == size  # frozen: stored whole, as before


def test_zero3_traffic_is_two_gathers_a_micro_batch_and_one_reduce_scatter_a_step():
    size = 4e6
    one, three = _pricer(True), _pricer(3)
    rate = lambda p, c: p._rate(c, 4)  # noqa: E731 (seconds per byte, latency apart)
    assert three.zero3_gathers(size) == pytest.approx(2 * size * rate(three, "all_gather"))
    assert one.zero3_gathers(size) == 0.0
    assert three.dp_sync(size) == pytest.approx(size * rate(three, "reduce_scatter"))  # copy_rate 0 here
    four = _pricer(3, update_freq=4)  # gathers every micro-batch, the reduce-scatter once a step
    assert four.zero3_gathers(size) == pytest.approx(three.zero3_gathers(size))
    assert four.dp_sync(size) == pytest.approx(three.dp_sync(size) / 4)
    # over a step of 4 micro-batches ZeRO-3 moves more than ZeRO-1, which reduces and gathers once
    one_four = _pricer(True, update_freq=4)
    assert four.zero3_gathers(size) + four.dp_sync(size) > 2 * one_four.dp_sync(size)
    assert three.zero3_latency(10) == pytest.approx(10 * 3e-4) and one.zero3_latency(10) == 0.0


def test_units_are_grouped_as_the_runtime_groups_them():
    """One rule (nnscaler.ir.contracts.unit_names) for the runtime's units and autodist's pricing."""
    from nnscaler.ir.contracts import unit_names
    from nnscaler.policies.autodist import cost_model
    from nnscaler.runtime import zero3
    assert cost_model.unit_names is unit_names and zero3.unit_names is unit_names


class _Stack(nn.Module):
    """Eight repeated blocks: their weights outweigh everything else."""

    def __init__(self, width=32, depth=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.sum()


def _graph():
    torch.manual_seed(0)
    return trace(_Stack(), {"x": torch.randn(2, 32)})


def test_gathered_units_are_the_root_and_two_blocks():
    from nnscaler.policies.autodist.cost_model import build_problem
    graph = _graph()
    problem = build_problem(graph, 1, {}, CommModel(COMM), cfg_of(3))
    assert set(problem.units) == {f"layers.{i}" for i in range(8)}
    block = 4 * (32 * 32 + 32)
    assert gathered_bytes(problem, [0] * len(problem.ops)) == pytest.approx(2 * 2 * block)
    assert gathered_bytes(build_problem(graph, 1, {}, CommModel(COMM), cfg_of(True)), [0] * len(problem.ops)) == 0.0


def test_a_limit_zero1_cannot_meet_is_met_with_zero3():
    """8 blocks of 4.2 KB (fp32): ZeRO-1 over 4 ranks needs about 84 KB, ZeRO-3 about 51 KB with its
    gathered blocks; a 70 KB limit."""
    limit_gb = 70e3 / 1024 ** 3

    def plan(use_zero):
        cc = ComputeConfig(1, 4, use_zero=use_zero, pas_config={"mem_constraint": limit_gb, "_comm_profile": COMM,
                                                                  "_profile_repeats": 1})
        return apply_policy(_graph(), cc, "autodist")
    with pytest.raises(NoPlanFits, match="no plan fits"):
        plan(True)
    graph = plan(3)
    assert all(node.pieces for node in graph.nodes)


def test_a_forced_pipeline_with_zero3_is_accepted():
    """The runtime shards each stage's parameters over its dp ranks, so autodist may pipeline under ZeRO-3."""
    cfg = AutodistConfig.from_compute_config(ComputeConfig(2, 4, use_zero=3, use_end2end=True,
                                                           pas_config={"pipeline_pivots": "Block",
                                                                       "pipeline_nstages": 2}))
    assert cfg.zero_stage == 3 and cfg.pipeline_nstages == 2
