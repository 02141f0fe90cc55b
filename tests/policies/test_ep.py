"""The `ep` policy (builtin/ep.py) on traced mixture-of-experts models: each routed-experts op is
split along its experts dim (tokens and experts over the plan's devices), every other op along the
batch or replicated; pipeline stages each split their experts; and each refusal names the values
and the fix."""
from __future__ import annotations

import pytest
import torch

from nnscaler.ir import ComputeConfig, Shard, trace
from nnscaler.ir.config import ConfigError
from nnscaler.ir.graph import IRGraph
from nnscaler.ir.ops.moe import EXPERT_DIM, ROUTED_EXPERTS, routed_experts
from nnscaler.policies import PlanError, apply_policy


class TinyMoE(torch.nn.Module):
    """Two MoE layers calling the op directly, with `experts` experts, top-`k`."""

    def __init__(self, experts=4, k=2, width=8):
        super().__init__()
        self.routers = torch.nn.ModuleList(torch.nn.Linear(width, experts, bias=False) for _ in range(2))
        self.up = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(experts, 2 * width, width) * 0.1) for _ in range(2))
        self.down = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(experts, width, width) * 0.1) for _ in range(2))
        self.k = k

    def forward(self, x):
        b, s, h = x.shape
        x = x.reshape(-1, h)
        for router, up, down in zip(self.routers, self.up, self.down):
            weights, index = router(x).softmax(-1).topk(self.k, dim=-1)
            x = x + routed_experts(x, index, weights, up, down)
        return x.reshape(b, s, h).square().mean()


class NotRecognised(torch.nn.Module):
    """A hand-written MoE block looping over its experts: nothing the recogniser knows."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        return sum(e(x) for e in self.experts).sum()


def _graph(model, x):
    torch.manual_seed(0)
    return IRGraph.from_json(trace(model, {"x": x}).to_json())


def test_experts_and_tokens_split_over_the_plan():
    graph = apply_policy(_graph(TinyMoE(), torch.randn(4, 2, 8)), ComputeConfig(2, 4), "ep")
    ops = [n for n in graph.nodes if n.target == ROUTED_EXPERTS]
    assert len(ops) == 2
    for node in ops:
        assert [p.dim for p in node.pieces] == [EXPERT_DIM, EXPERT_DIM] and [p.device for p in node.pieces] == [0, 1]
        assert all(isinstance(pl, Shard) and pl.dim == 0 for pl in node.pieces[0].inputs + node.pieces[0].outputs)
    linear = next(n for n in graph.nodes if n.target.endswith("linear"))
    assert linear.pieces[0].dim is not None  # the router splits along the tokens


def test_pipeline_stages_split_their_experts():
    cfg = ComputeConfig(4, 4, use_end2end=True, pas_config={"pp_size": 2, "pipeline_nmicros": 2})
    graph = apply_policy(_graph(TinyMoE(), torch.randn(4, 2, 8)), cfg, "ep")
    ops = [n for n in graph.nodes if n.target == ROUTED_EXPERTS]
    assert [n.stage for n in ops] == [0, 1]
    assert [[p.device for p in n.pieces] for n in ops] == [[0, 1], [2, 3]]


def test_ep_size_between_stores_the_experts_over_every_stage_device(tmp_path):
    """ep_size 2 in stages of 4 devices (pp 2 of 8): the experts stored 1/4 per device (Shard(0), as full
    ep), the piece's dim "e:2"; every rank creates each stage's groups of 2 and replica sets."""
    from nnscaler.codegen import generate
    from nnscaler.ir import expert_group
    cfg = ComputeConfig(8, 8, use_end2end=True, pas_config={"pp_size": 2, "pipeline_nmicros": 2, "ep_size": 2})
    graph = apply_policy(_graph(TinyMoE(experts=8), torch.randn(16, 2, 8)), cfg, "ep")
    ops = [n for n in graph.nodes if n.target == ROUTED_EXPERTS]
    assert [[p.device for p in n.pieces] for n in ops] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for node in ops:
        assert [expert_group(p.dim) for p in node.pieces] == [(True, 2)] * 4
        assert all(isinstance(pl, Shard) and pl.dim == 0 for pl in node.pieces[0].inputs)
    generate(graph, cfg, tmp_path / "gen")
    code = (tmp_path / "gen" / "gencode5.py").read_text()
    assert "(0, 1), (2, 3), (4, 5), (6, 7), (0, 2), (1, 3), (4, 6), (5, 7))" in code
    assert code.count("ep_size=2") == 1 and "ranks=(4, 5, 6, 7)" in code  # the stage's ranks, its groups inside
    assert "full_shape=(8, 16, 8), slices=((2, 4), (0, 16), (0, 8))" in code  # device 5: experts 2, 3 of 8


def test_experts_not_divisible_by_the_ep_size():
    with pytest.raises(PlanError, match=r"has 6 experts, which do not split over the expert-parallel size 4 .*"
                                        r"plan_ngpus=3"):
        apply_policy(_graph(TinyMoE(experts=6), torch.randn(4, 2, 8)), ComputeConfig(4, 4), "ep")


def test_tokens_not_divisible_by_the_ep_size():
    with pytest.raises(PlanError, match="receives 6 tokens .* into 4 equal parts"):
        apply_policy(_graph(TinyMoE(), torch.randn(3, 2, 8)), ComputeConfig(4, 4), "ep")


def test_a_model_without_a_recognised_experts_op():
    with pytest.raises(PlanError, match=r"found no routed-experts op .*modules that look like experts but were traced "
                                        r"op by op: experts.*nnscaler\.routed_experts"):
        apply_policy(_graph(NotRecognised(), torch.randn(4, 8)), ComputeConfig(2, 2), "ep")


def test_pipeline_needs_end2end():
    with pytest.raises(ConfigError, match="use_end2end=True"):
        apply_policy(_graph(TinyMoE(), torch.randn(4, 2, 8)),
                     ComputeConfig(4, 4, pas_config={"pp_size": 2, "pipeline_nmicros": 2}), "ep")


def test_autodist_sees_the_expert_dimension(tmp_path, monkeypatch):
    from nnscaler.policies.autodist.choices import node_choices
    monkeypatch.setenv("NNSCALER_CACHE_DIR", str(tmp_path))
    graph = _graph(TinyMoE(experts=8, width=64), torch.randn(2, 8, 64))
    node = next(n for n in graph.nodes if n.target == ROUTED_EXPERTS)
    assert [c.label for c in node_choices(graph, node, 2)] == ["R", "t", "e"]
    assert [c.label for c in node_choices(graph, node, 16)] == ["R", "t"]  # 8 experts do not split 16 ways
    # the experts' weights, gradients and Adam state take 3.1 MB replicated, 1.6 MB split in two:
    # only expert parallelism fits 2.5 MB
    comm = {"backend": "given", "collectives": {c: {"2": [1e-5, 5e9]} for c in
                                                ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}}
    planned = apply_policy(graph, ComputeConfig(2, 2, pas_config={"mem_constraint": 0.0025, "_comm_profile": comm,
                                                                  "_profile_repeats": 1}), "autodist")
    ops = [n for n in planned.nodes if n.target == ROUTED_EXPERTS]
    assert all(n.pieces[0].dim == EXPERT_DIM and len(n.pieces) == 2 for n in ops)


def test_tp_modules_follow_megatron_inside_them():
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.o_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.o_proj(torch.relu(self.q_proj(x)))

    class Block(TinyMoE):
        def __init__(self):
            super().__init__()
            self.self_attn = Attn()

        def forward(self, x):
            return super().forward(self.self_attn(x))

    graph = apply_policy(_graph(Block(), torch.randn(4, 2, 8)),
                         ComputeConfig(2, 2, pas_config={"tp_modules": ["*self_attn"]}), "ep")
    dims = {n.module_path: n.pieces[0].dim for n in graph.nodes if n.target.endswith("linear")}
    assert dims["self_attn.q_proj"] == "n" and dims["self_attn.o_proj"] == "k"  # column, then row parallel
    assert all(n.pieces[0].dim == EXPERT_DIM for n in graph.nodes if n.target == ROUTED_EXPERTS)
    with pytest.raises(ConfigError, match=r"pas_config\['tp_modules'\] must be a module path glob"):
        apply_policy(_graph(Block(), torch.randn(4, 2, 8)), ComputeConfig(2, 2, pas_config={"tp_modules": [3]}), "ep")
