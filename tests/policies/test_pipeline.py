"""Pipeline primitives on traced graphs: pivot_leads, stage, op_weight, cut_stages, schedule,
stage_devices, and validate_plan / apply_policy on pipelined plans."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt import GPT, GPTConfig, random_batch
from nnscaler.ir import ComputeConfig, trace
from nnscaler.ir.config import ConfigError
from nnscaler.ir.graph import IRGraph
from nnscaler.policies import (PlanError, apply_policy, assign, cut_stages, pivot_leads, replicate, schedule,
                               stage, stage_devices, validate_plan)
from nnscaler.policies.pipeline import op_weight

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)


class Tiny(nn.Module):
    """A dozen ops of mixed weight (views and transposes are light)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        h = F.relu(self.a(x)).view(4, 8).transpose(0, 1).transpose(0, 1)
        h = torch.tanh(self.b(h)) + h
        h = F.gelu(self.c(h)).reshape(2, 16)
        return h.sum()


@pytest.fixture(scope="module")
def gpt_json():
    torch.manual_seed(0)
    return trace(GPT(CFG), random_batch(0, 4, CFG)).to_json()


@pytest.fixture
def gpt(gpt_json):
    return IRGraph.from_json(gpt_json)  # a fresh, unplanned copy per test


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return trace(Tiny(), {"x": torch.randn(4, 8)})


def first_op(graph, path):
    return next(i for i, n in enumerate(graph.nodes) if n.module_path == path or n.module_path.startswith(path + "."))


def block_starts(graph):
    return [first_op(graph, f"h.{k}") for k in range(CFG.n_layer)]


def stage_weights(graph, leads):
    bounds = [0, *leads, len(graph.nodes)]
    return [sum(op_weight(n) for n in graph.nodes[a:b]) for a, b in zip(bounds, bounds[1:])]


def best_max_weight(graph, nstages, candidates):
    """Brute force: the least max stage weight over every choice of nstages - 1 cut points."""
    return min(max(stage_weights(graph, list(c))) for c in itertools.combinations(sorted(candidates), nstages - 1))


# -- pivot_leads -----------------------------------------------------------------------------

def test_pivot_leads_by_class_name_are_the_block_starts(gpt):
    leads = pivot_leads(gpt, "Block")
    assert leads == block_starts(gpt)
    assert [gpt.nodes[i].module_path.split(".")[:2] for i in leads] == [["h", str(k)] for k in range(4)]
    assert all(not gpt.nodes[i - 1].module_path.startswith(gpt.nodes[i].module_path[:3]) for i in leads)


def test_pivot_leads_by_dotted_class(gpt):
    assert pivot_leads(gpt, "gpt.Block") == block_starts(gpt)
    assert pivot_leads(gpt, "torch.nn.modules.linear.Linear") == pivot_leads(gpt, "Linear")
    with pytest.raises(ConfigError, match="matches no module"):
        pivot_leads(gpt, "other.Block")  # a dotted class must match the whole qualified name


def test_pivot_leads_by_path_glob_match_one_segment_per_star(gpt):
    assert pivot_leads(gpt, "h.*") == block_starts(gpt)  # the blocks, not their sub-modules
    assert pivot_leads(gpt, "h.1") == [first_op(gpt, "h.1")]
    assert pivot_leads(gpt, "h.*.mlp") == [first_op(gpt, f"h.{k}.mlp") for k in range(4)]
    assert pivot_leads(gpt, "h.[02]") == [first_op(gpt, "h.0"), first_op(gpt, "h.2")]


def test_pivot_leads_comma_string_and_list(gpt):
    both = sorted(block_starts(gpt) + [first_op(gpt, f"h.{k}.mlp") for k in range(4)])
    assert pivot_leads(gpt, "Block, MLP") == both
    assert pivot_leads(gpt, ["Block", " MLP "]) == both
    assert pivot_leads(gpt, ("MLP",)) == [first_op(gpt, f"h.{k}.mlp") for k in range(4)]
    assert pivot_leads(gpt, "Block,,") == block_starts(gpt)  # empty items are ignored


def test_pivot_leads_nested_matches_at_one_op_give_one_lead(gpt):
    # h.k and h.k.ln_1 start at the same op: one lead each block, still strictly increasing
    assert pivot_leads(gpt, "Block,LayerNorm") == sorted(
        set(block_starts(gpt)) | {first_op(gpt, f"h.{k}.ln_2") for k in range(4)} | {first_op(gpt, "ln_f")})


def test_pivot_leads_no_match_lists_the_module_classes(gpt):
    with pytest.raises(ConfigError, match=r"pipeline_pivots 'Nope' matches no module of gpt.GPT; its module "
                                          r"classes are: Block, CausalSelfAttention, Embedding, LayerNorm, Linear, "
                                          r"MLP \(or give module path globs\)"):
        pivot_leads(gpt, "Nope")
    with pytest.raises(ConfigError, match="matches no module"):
        pivot_leads(gpt, "GPT")  # the root module is no pivot: it starts at op 0


@pytest.mark.parametrize("bad", [5, None, ["Block", 3], {"Block"}, b"Block"])
def test_pivot_leads_bad_types(gpt, bad):
    with pytest.raises(ConfigError, match=r"pipeline_pivots must be a comma-separated string of module class "
                                          r"names or module paths \(e.g. 'Block' or 'blocks.\*'\)"):
        pivot_leads(gpt, bad)


@pytest.mark.parametrize("empty", ["", " , ", []])
def test_pivot_leads_empty(gpt, empty):
    with pytest.raises(ConfigError, match=r"names no module: give module class names or paths, e.g. 'Block'"):
        pivot_leads(gpt, empty)


# -- stage / op_weight -----------------------------------------------------------------------

def test_stage_cuts_before_each_lead(gpt):
    leads = block_starts(gpt)[1:3]
    stages = stage(gpt, leads)
    assert [len(s) for s in stages] == [leads[0], leads[1] - leads[0], len(gpt.nodes) - leads[1]]
    assert [n for s in stages for n in s] == gpt.nodes
    assert [n.stage for n in gpt.nodes] == [k for k, s in enumerate(stages) for _ in s]
    assert stages[1][0].module_path.startswith("h.1")


def test_stage_takes_nodes_and_no_leads(gpt):
    lead = gpt.nodes[first_op(gpt, "h.2")]
    assert stage(gpt, [lead])[1][0] is lead
    assert len(stage(gpt, [])) == 1 and {n.stage for n in gpt.nodes} == {0}


@pytest.mark.parametrize("leads,match", [
    ([0], r"stage lead 0 is not an op of the graph after its first op \(indices 1\.\.\d+\)"),
    ([-1], r"stage lead -1 is not an op"),
    ([10 ** 6], r"stage lead 1000000 is not an op"),
    ([True], r"stage lead True is not an op"),
    (["5"], r"stage lead '5' is not an op"),
    ([1.0], r"stage lead 1.0 is not an op"),
    ([40, 10], r"stage leads must be strictly increasing op indices, got \[40, 10\]"),
    ([10, 10], r"strictly increasing"),
])
def test_stage_bad_leads(gpt, leads, match):
    with pytest.raises(PlanError, match=match):
        stage(gpt, leads)


def test_stage_refuses_a_node_of_another_graph(gpt, gpt_json):
    other = IRGraph.from_json(gpt_json)
    with pytest.raises(PlanError, match="is not an op of the graph"):
        stage(gpt, [other.nodes[5]])


def test_op_weight_light_ops(gpt):
    by_name = {n.short_name: op_weight(n) for n in gpt.nodes}
    for light in ("view", "transpose", "size", "contiguous", "__getitem__"):
        assert by_name[light] == 0.1, light
    for heavy in ("linear", "layer_norm", "softmax", "cross_entropy", "embedding"):
        assert by_name[heavy] == 1.0, heavy


# -- cut_stages ------------------------------------------------------------------------------

def test_cut_stages_two_stages_of_four_blocks_cut_at_h2(gpt):
    stages = cut_stages(gpt, 2, pivot_leads(gpt, "Block"))
    assert stages[1][0] is gpt.nodes[first_op(gpt, "h.2")]
    assert {n.stage for n in stages[0]} == {0} and {n.stage for n in stages[1]} == {1}


@pytest.mark.parametrize("nstages", [1, 2, 3, 4, 5])
def test_cut_stages_is_the_min_max_optimum_over_block_starts(gpt, nstages):
    cands = pivot_leads(gpt, "Block")
    stages = cut_stages(gpt, nstages, cands)
    leads = [gpt.nodes.index(s[0]) for s in stages[1:]]
    assert len(stages) == nstages and set(leads) <= set(cands)
    assert max(stage_weights(gpt, leads)) == pytest.approx(best_max_weight(gpt, nstages, cands))


@pytest.mark.parametrize("nstages", [1, 2, 3, 4, 5, 6])
def test_cut_stages_is_the_min_max_optimum_at_any_op(tiny, nstages):
    stages = cut_stages(tiny, nstages)
    assert all(stages) and [n for s in stages for n in s] == tiny.nodes
    leads = [tiny.nodes.index(s[0]) for s in stages[1:]]
    assert [n.stage for n in tiny.nodes] == [k for k, s in enumerate(stages) for _ in s]
    assert max(stage_weights(tiny, leads)) == pytest.approx(
        best_max_weight(tiny, nstages, range(1, len(tiny.nodes))))


@pytest.mark.parametrize("cands", [[2, 3, 5, 7], [1, 9], [4, 5, 6, 7, 8]])
def test_cut_stages_only_at_candidates(tiny, cands):
    for nstages in range(2, len(cands) + 2):
        leads = [tiny.nodes.index(s[0]) for s in cut_stages(tiny, nstages, cands)[1:]]
        assert set(leads) <= set(cands)
        assert max(stage_weights(tiny, leads)) == pytest.approx(best_max_weight(tiny, nstages, cands))


def test_cut_stages_ignores_out_of_range_candidates(tiny):
    n = len(tiny.nodes)
    stages = cut_stages(tiny, 2, [0, 3, n, n + 5, -1])
    assert tiny.nodes.index(stages[1][0]) == 3


def test_cut_stages_too_many_stages_for_the_pivots(gpt):
    with pytest.raises(ConfigError, match=r"cannot cut gpt.GPT into pipeline_nstages=6 stages: it has only 4 "
                                          r"pivot module starts after the first op to cut at \(need 5\); lower "
                                          r"pipeline_nstages or give more pipeline_pivots"):
        cut_stages(gpt, 6, pivot_leads(gpt, "Block"))


def test_cut_stages_too_many_stages_for_the_ops(tiny):
    n = len(tiny.nodes)
    assert len(cut_stages(tiny, n)) == n  # one op per stage is the most
    with pytest.raises(ConfigError, match=rf"pipeline_nstages={n + 1} stages: it has only {n - 1} op boundaries "
                                          rf"to cut at \(need {n}\); lower pipeline_nstages$"):
        cut_stages(tiny, n + 1)


@pytest.mark.parametrize("bad", [0, -1, True, "2", 2.0, None])
def test_cut_stages_bad_nstages(tiny, bad):
    with pytest.raises(ConfigError, match=r"pipeline_nstages must be a positive integer"):
        cut_stages(tiny, bad)


class Filled(nn.Module):
    """A tensor filled in place through views of a new one (DeepSeek-V3's attention key) and one
    written in place directly, between plain ops."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        key = h.new_empty(h.shape)
        key[:, :4].copy_(h[:, :4])
        key[:, 4:].copy_(torch.sigmoid(h[:, 4:]))
        y = F.relu(self.b(key))
        y.mul_(2.0)
        return torch.exp(y).sum()


@pytest.fixture(scope="module")
def filled_json():
    torch.manual_seed(0)
    return trace(Filled(), {"x": torch.randn(4, 8)}).to_json()


def test_write_spans_and_no_cut_inside_them(filled_json):
    """A stage never starts between an in-place write and the producer of what it writes (through
    views): the next stage would write into a received copy (autograd refuses an in-place op on a
    received leaf; through a view the write would be lost). `cut_stages` keeps the min-max optimum
    over the other boundaries; `stage` refuses such a lead, naming the write."""
    from nnscaler.policies.inplace_writes import write_spans
    graph = IRGraph.from_json(filled_json)
    names = [n.short_name for n in graph.nodes]
    spans = [(first, last, names[first], w.short_name) for first, last, w in write_spans(graph)]
    assert [(f, w) for _, _, f, w in spans] == [("new_empty", "copy_"), ("new_empty", "copy_"), ("relu", "mul_")], spans
    inside = {c for first, last, *_ in spans for c in range(first + 1, last + 1)}
    allowed = set(range(1, len(graph.nodes))) - inside
    for nstages in range(2, len(allowed) + 2):
        stages = cut_stages(IRGraph.from_json(filled_json), nstages)
        leads = [sum(len(s) for s in stages[:k]) for k in range(1, nstages)]
        assert not set(leads) & inside, (nstages, leads)
        assert max(stage_weights(graph, leads)) == pytest.approx(best_max_weight(graph, nstages, allowed))
    first, last = spans[1][:2]
    with pytest.raises(PlanError, match=rf"a stage would start at op {last} .*between op {first} "
                                        rf".*new_empty.*op {last}: torch.Tensor.copy_.*Cut at op {first} or before"):
        stage(IRGraph.from_json(filled_json), [last])


# -- schedule / stage_devices ----------------------------------------------------------------

def test_schedule_stores_the_plan(gpt):
    cut_stages(gpt, 4, pivot_leads(gpt, "Block"))
    plan = schedule(gpt, 8)
    assert gpt.pipeline is plan
    assert (plan.nstages, plan.nmicros, plan.scheduler, plan.pp_size, plan.tp_size) == (4, 8, "1f1b", 4, 1)
    plan = schedule(gpt, 4, "1f1b_interleaved", pp_size=2, tp_size=2)
    assert gpt.pipeline is plan and plan.plan_ngpus == 4
    node = gpt.nodes[first_op(gpt, "h.3")]
    assert stage_devices(gpt, node) == (2, 3)  # stage 3 -> pipeline device 1 -> plan devices 2, 3


def test_schedule_refuses_unstaged_ops(gpt):
    with pytest.raises(PlanError, match=r"op torch.Tensor.size .* has no pipeline stage: call stage\(\) or "
                                        r"cut_stages\(\) first"):
        schedule(gpt, 4)
    stage(gpt, [10])
    gpt.nodes[20].stage = None
    with pytest.raises(PlanError, match="has no pipeline stage"):
        schedule(gpt, 4)
    assert gpt.pipeline is None


def test_schedule_refuses_empty_stages(gpt):
    stage(gpt, [])
    gpt.nodes[-1].stage = 3
    with pytest.raises(PlanError, match=r"pipeline stages \[1, 2\] have no ops"):
        schedule(gpt, 4)


def test_schedule_refuses_a_schedule_that_cannot_apply(gpt):
    cut_stages(gpt, 2, pivot_leads(gpt, "Block"))
    with pytest.raises(ConfigError, match=r"'chimera_direct' needs nstages \(pipeline_nstages\) == 4"):
        schedule(gpt, 4, "chimera_direct")
    with pytest.raises(ConfigError, match=r"ndevices \(pp_size\) must equal nstages"):
        schedule(gpt, 4, "1f1b", pp_size=1)
    assert gpt.pipeline is None


def test_stage_devices_needs_a_scheduled_pipeline(gpt):
    with pytest.raises(PlanError, match=r"is not in a scheduled pipeline: call stage\(\) and schedule\(\) first"):
        stage_devices(gpt, gpt.nodes[0])
    stage(gpt, [40])
    with pytest.raises(PlanError, match="not in a scheduled pipeline"):
        stage_devices(gpt, gpt.nodes[0])


# -- validate_plan / apply_policy on pipelines -----------------------------------------------

def place_on_stages(graph):
    for node in graph.nodes:
        devices = stage_devices(graph, node)
        for device, piece in zip(devices, replicate(graph, node, len(devices))):
            assign(piece, device)


def two_stage_plan(graph, tp_size=1):
    cut_stages(graph, 2, pivot_leads(graph, "Block"))
    schedule(graph, 4, "1f1b", pp_size=2, tp_size=tp_size)
    place_on_stages(graph)


def test_validate_accepts_ops_on_their_stage_devices(gpt):
    two_stage_plan(gpt, tp_size=2)
    validate_plan(gpt, 4, "mine")
    assert {p.device for n in gpt.nodes if n.stage == 1 for p in n.pieces} == {2, 3}


def test_validate_refuses_ops_on_wrong_devices(gpt):
    two_stage_plan(gpt)
    last = gpt.nodes[-1]
    assign(last, 0)
    with pytest.raises(PlanError, match=r"policy 'mine': op torch.nn.functional.cross_entropy .* of stage 1 runs "
                                        r"on plan devices \[0\]; a stage's ops run on its devices \[1\] "
                                        r"\(stage_devices\(\)\)"):
        validate_plan(gpt, 2, "mine")


def test_validate_refuses_a_write_in_another_stage_than_its_target(filled_json):
    """Stages set by hand (not through `stage`): an in-place write apart from its target's producer."""
    from nnscaler.policies.inplace_writes import write_spans
    graph = IRGraph.from_json(filled_json)
    cut_stages(graph, 2)
    schedule(graph, 2, "1f1b", pp_size=2)
    first, last, write = write_spans(graph)[1]
    for i, node in enumerate(graph.nodes):  # stage 1 starts right after the key's new_empty
        node.stage = 0 if i <= first else 1
    place_on_stages(graph)
    with pytest.raises(PlanError, match=r"policy 'mine': the in-place write torch.Tensor.copy_ .* runs in stage 1, "
                                        r"but torch.Tensor.new_empty .* in stage 0: .* Put them in one stage"):
        validate_plan(graph, 2, "mine")


def test_validate_refuses_an_op_on_too_few_stage_devices(gpt):
    two_stage_plan(gpt, tp_size=2)
    assign(replicate(gpt, gpt.nodes[0], 1)[0], 0)
    with pytest.raises(PlanError, match=r"of stage 0 runs on plan devices \[0\]; a stage's ops run on its devices "
                                        r"\[0, 1\]"):
        validate_plan(gpt, 4, "mine")


def test_validate_refuses_stages_without_schedule(gpt):
    cut_stages(gpt, 2, pivot_leads(gpt, "Block"))
    for node in gpt.nodes:
        assign(replicate(gpt, node, 1)[0], 0)
    with pytest.raises(PlanError, match=r"policy 'mine' cut the graph into stages but gave no schedule: call "
                                        r"nnscaler.policies.schedule\(graph, nmicros, scheduler, ...\)"):
        validate_plan(gpt, 1, "mine")


def test_validate_refuses_pipeline_size_other_than_plan_ngpus(gpt):
    two_stage_plan(gpt)
    with pytest.raises(PlanError, match=r"policy 'mine': the pipeline has pp_size 2 x tp_size 1 = 2 devices, but "
                                        r"plan_ngpus is 4"):
        validate_plan(gpt, 4, "mine")


def test_validate_refuses_an_op_outside_the_stages(gpt):
    two_stage_plan(gpt)
    gpt.nodes[3].stage = None
    with pytest.raises(PlanError, match=r"op .* has stage None, not one of the 2 pipeline stages"):
        validate_plan(gpt, 2, "mine")
    gpt.nodes[3].stage = 2
    with pytest.raises(PlanError, match="has stage 2, not one of the 2 pipeline stages"):
        validate_plan(gpt, 2, "mine")


def custom_pipeline(graph, cfg):
    two_stage_plan(graph)
    return graph


def test_apply_policy_accepts_a_custom_pipeline_end_to_end(gpt):
    apply_policy(gpt, ComputeConfig(2, 4, use_end2end=True), custom_pipeline)
    assert gpt.pipeline.nstages == 2


def test_apply_policy_refuses_a_pipeline_without_end2end(gpt):
    with pytest.raises(ConfigError, match=r"made a pipeline, which runs only end to end: set "
                                          r"ComputeConfig\(use_end2end=True\)"):
        apply_policy(gpt, ComputeConfig(2, 2), custom_pipeline)


def test_apply_policy_accepts_a_pipeline_with_zero(gpt):
    apply_policy(gpt, ComputeConfig(2, 4, use_end2end=True, use_zero=True), custom_pipeline)
    assert gpt.pipeline.nstages == 2
