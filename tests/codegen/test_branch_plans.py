"""Pipelined plans (`hybrid`, `ep` with pp_size) over a forward whose SDPA mask is a both-branch
argument (codegen/branches.py): the placements the policy gives each op match its tensor inputs
at generation. Before, generation dropped the untraced branch of a pipelined graph after the policy
had placed it, so SDPA kept 4 input placements for 3 inputs and DeepSeek-V3 under ``hybrid`` and
``pp x ep`` was refused with "the plan gives 4 input and 1 output placements for 3 tensor inputs"."""
from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models"))
import hf_models  # noqa: E402
from nnscaler.codegen import generate  # noqa: E402
from nnscaler.ir import ComputeConfig, trace
from nnscaler.ir.tracer.branches import keep_traced_branch
from nnscaler.policies import apply_policy

from test_guard_code import MaskOrCausal

PLANS = {"hybrid": ("hybrid", {"pp_size": 2, "pipeline_nstages": 2, "pipeline_nmicros": 2}),
         "pp x ep": ("ep", {"pp_size": 2, "pipeline_nmicros": 2})}


@pytest.fixture(scope="module")
def deepseek_json():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hf_models.make("deepseek_v3", torch.float64)
        batch = hf_models.batch("deepseek_v3", 0, 4, torch.float64, False)
        return trace(model, {k: v[:2] for k, v in batch.items()}).to_json()


def _sdpa(graph):
    return [n for n in graph.nodes if n.target.endswith("scaled_dot_product_attention")]


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_deepseek_v3_pipelined_plans_generate(deepseek_json, plan, tmp_path):
    from nnscaler.ir.graph import IRGraph
    policy, pas = PLANS[plan]
    if plan == "hybrid":
        pas = dict(pas, pipeline_pivots="DeepseekV3DecoderLayer")
    cfg = ComputeConfig(4, 4, use_end2end=True, trace_strategy="cpu", pas_config=pas)
    graph = apply_policy(IRGraph.from_json(deepseek_json), cfg, policy)
    sdpa = _sdpa(graph)
    assert sdpa and all(n.branch_args for n in sdpa)  # the mask: a tensor on one branch, None on the other
    assert any(not p.is_replicated() for n in sdpa for p in n.pieces)  # split within each stage
    assert len(generate(graph, cfg, tmp_path, policy)) == 4


def test_keep_traced_branch_refuses_a_placed_graph():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(MaskOrCausal(), {"x": torch.randn(4, 3, 8), "attention_mask": torch.ones(4, 3)})
    graph = apply_policy(graph, ComputeConfig(2, 2, trace_strategy="cpu"), "tp")
    with pytest.raises(ValueError, match="before the policy"):
        keep_traced_branch(graph)
