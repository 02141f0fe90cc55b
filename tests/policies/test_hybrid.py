"""The `hybrid` and `pp` policies (builtin/hybrid.py) through apply_policy on a traced GPT:
every pas_config rule of the user's spec, accepted and refused (one test per refusal)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt import GPT, GPTConfig, random_batch
from nnscaler.ir import ComputeConfig, trace
from nnscaler.ir.config import ConfigError
from nnscaler.ir.graph import IRGraph
from nnscaler.policies import apply_policy

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)


@pytest.fixture(scope="module")
def gpt_json():
    torch.manual_seed(0)
    return trace(GPT(CFG), random_batch(0, 4, CFG)).to_json()


@pytest.fixture
def run(gpt_json):
    """run(policy, plan_ngpus, runtime_ngpus=None, cfg flags..., **pas) -> the planned graph."""
    def go(policy="hybrid", plan=4, runtime=None, *, end2end=True, zero=False, inference=False, **pas):
        graph = IRGraph.from_json(gpt_json)
        cfg = ComputeConfig(plan, runtime or plan, use_end2end=end2end, use_zero=zero, inference_only=inference,
                            pas_config=pas)
        return apply_policy(graph, cfg, policy)
    return go


def first_op(graph, path):
    return next(i for i, n in enumerate(graph.nodes) if n.module_path == path or n.module_path.startswith(path + "."))


def stage_starts(graph):
    """Module path of the first op of each stage after stage 0."""
    return [graph.nodes[i].module_path for i in range(1, len(graph.nodes))
            if graph.nodes[i].stage != graph.nodes[i - 1].stage]


def devices(node):
    return sorted(p.device for p in node.pieces)


def pipe(graph):
    p = graph.pipeline
    return (p.nstages, p.nmicros, p.scheduler, p.pp_size, p.tp_size)


def check_stage_placement(graph):
    """Every op runs on its stage's home devices, split on the batch dim or replicated."""
    plan = graph.pipeline
    stages = [n.stage for n in graph.nodes]
    assert stages == sorted(stages) and set(stages) == set(range(plan.nstages))
    for node in graph.nodes:
        assert devices(node) == list(plan.home_devices(node.stage)), node.describe()
        assert len({p.dim for p in node.pieces}) == 1


# -- hybrid: accepted configurations ---------------------------------------------------------

def test_hybrid_auto_without_pivots_does_not_pipeline(run):
    graph = run(plan=2, pipeline_nmicros=4)
    assert graph.pipeline is None and all(n.stage is None for n in graph.nodes)
    assert all(devices(n) == [0, 1] for n in graph.nodes)  # tensor parallel on dim 0 over the unit
    linear = graph.nodes[first_op(graph, "h.0.attn.q_proj")]
    assert linear.pieces[0].dim is not None  # the batch dim splits


def test_hybrid_auto_with_pivots_uses_one_stage_per_device(run):
    graph = run(plan=4, pipeline_nmicros=4, pipeline_pivots="Block")
    assert pipe(graph) == (4, 4, "1f1b", 4, 1)
    assert stage_starts(graph) == ["h.1.ln_1", "h.2.ln_1", "h.3.ln_1"]  # balanced over the block starts
    check_stage_placement(graph)


def test_hybrid_auto_with_pivots_caps_stages_at_the_pivots(run):
    # 4 blocks allow 5 stages; the largest divisor of 8 not above 5 is 4, so tp_size 2
    graph = run(plan=8, pipeline_nmicros=4, pipeline_pivots="Block")
    assert pipe(graph) == (4, 4, "1f1b", 4, 2)
    check_stage_placement(graph)
    linear = graph.nodes[first_op(graph, "h.3.mlp.c_fc")]
    assert devices(linear) == [6, 7] and linear.pieces[0].dim is not None


def test_hybrid_auto_with_pivots_and_pp_size(run):
    graph = run(plan=4, pipeline_nmicros=2, pipeline_pivots="Block", pp_size=2)
    assert pipe(graph) == (2, 2, "1f1b", 2, 2)
    assert stage_starts(graph) == ["h.2.ln_1"]
    check_stage_placement(graph)


def test_hybrid_auto_with_pivots_on_one_device_does_not_pipeline(run):
    graph = run(plan=1, pipeline_nmicros=2, pipeline_pivots="Block")
    assert graph.pipeline is None and all(devices(n) == [0] for n in graph.nodes)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return F.relu(self.fc(x))


class Stack(nn.Module):
    """Its first op is inside the first pivot module: that start is no cut point."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_hybrid_auto_counts_only_pivots_after_the_first_op():
    graph = trace(Stack(), {"x": torch.randn(4, 8)})
    cfg = ComputeConfig(4, 4, use_end2end=True, pas_config={"pipeline_nmicros": 2, "pipeline_pivots": "Layer"})
    apply_policy(graph, cfg, "hybrid")  # 3 layers, one starting at op 0: at most 3 stages -> 2 divide 4
    assert pipe(graph) == (2, 2, "1f1b", 2, 2)
    check_stage_placement(graph)


def test_hybrid_nstages_1_does_not_pipeline(run):
    graph = run(plan=2, pipeline_nmicros=4, pipeline_nstages=1, pp_size=1)
    assert graph.pipeline is None and all(devices(n) == [0, 1] for n in graph.nodes)


def test_hybrid_nstages_with_pivots(run):
    graph = run(plan=2, pipeline_nmicros=4, pipeline_nstages=2, pipeline_pivots="Block")
    assert pipe(graph) == (2, 4, "1f1b", 2, 1)  # pp_size defaults to pipeline_nstages
    assert stage_starts(graph) == ["h.2.ln_1"]
    check_stage_placement(graph)


def test_hybrid_nstages_with_path_glob_pivots(run):
    graph = run(plan=2, pipeline_nmicros=4, pipeline_nstages=2, pipeline_pivots="h.*")
    assert stage_starts(graph) == ["h.2.ln_1"]


def test_hybrid_interleaved(run):
    graph = run(plan=2, pipeline_nmicros=4, pipeline_nstages=4, pp_size=2, pipeline_pivots="Block",
                pipeline_scheduler="1f1b_interleaved")
    assert pipe(graph) == (4, 4, "1f1b_interleaved", 2, 1)
    check_stage_placement(graph)
    assert devices(graph.nodes[first_op(graph, "h.2")]) == [devices(graph.nodes[first_op(graph, "h.0")])[0]]
    assert graph.pipeline.stages_of(0) == [(0, 0), (2, 0)]


def test_hybrid_interleaved_with_tensor_parallel(run):
    graph = run(plan=4, pipeline_nmicros=2, pipeline_nstages=4, pp_size=2, pipeline_pivots="Block",
                pipeline_scheduler="1f1b_interleaved")
    assert pipe(graph) == (4, 2, "1f1b_interleaved", 2, 2)
    check_stage_placement(graph)


def test_hybrid_chimera(run):
    graph = run(plan=4, pipeline_nmicros=4, pipeline_nstages=4, pipeline_pivots="Block",
                pipeline_scheduler="chimera_direct")
    assert pipe(graph) == (4, 4, "chimera_direct", 4, 1)
    check_stage_placement(graph)  # pieces on the home replica (micro-batch 0)
    assert graph.pipeline.stage_groups(3) == [3, 0]


@pytest.mark.parametrize("scheduler", ["1f1b", "1f1b_plus", "gpipe"])
def test_hybrid_training_schedulers(run, scheduler):
    graph = run(plan=2, pipeline_nmicros=3, pipeline_nstages=2, pipeline_pivots="Block", pipeline_scheduler=scheduler)
    assert graph.pipeline.scheduler == scheduler


def test_hybrid_inference_defaults_to_infer_pipe(run):
    graph = run(plan=2, inference=True, pipeline_nmicros=2, pipeline_pivots="Block")
    assert pipe(graph) == (2, 2, "infer_pipe", 2, 1)
    check_stage_placement(graph)


def test_hybrid_data_parallel_across_units_and_private_keys(run):
    graph = run(plan=2, runtime=8, pipeline_nmicros=2, pipeline_pivots="Block", _pas_name="mine",
                recompute_modules="Block")
    assert pipe(graph) == (2, 2, "1f1b", 2, 1)


def test_hybrid_without_pipeline_allows_zero(run):
    graph = run(plan=2, runtime=4, zero=True, pipeline_nmicros=1)
    assert graph.pipeline is None


# -- pp: accepted configurations -------------------------------------------------------------

def test_pp_defaults_one_stage_per_device_at_any_op(run):
    graph = run("pp", plan=4, pipeline_nmicros=4)
    assert pipe(graph) == (4, 4, "1f1b", 4, 1)
    check_stage_placement(graph)
    assert all(len(n.pieces) == 1 for n in graph.nodes)  # tp_size 1


def test_pp_with_pivots(run):
    graph = run("pp", plan=2, pipeline_nmicros=4, pipeline_pivots="Block")
    assert stage_starts(graph) == ["h.2.ln_1"]
    check_stage_placement(graph)


def test_pp_interleaved_defaults_to_two_stages_per_device(run):
    graph = run("pp", plan=2, pipeline_nmicros=4, pipeline_scheduler="1f1b_interleaved")
    assert pipe(graph) == (4, 4, "1f1b_interleaved", 2, 1)
    check_stage_placement(graph)


def test_pp_on_one_device_does_not_pipeline(run):
    graph = run("pp", plan=1, pipeline_nmicros=4)
    assert graph.pipeline is None and all(devices(n) == [0] for n in graph.nodes)
    assert run("pp", plan=1, pipeline_nmicros=4, pipeline_nstages=1).pipeline is None


# -- refused: both policies ------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["hybrid", "pp"])
def test_refuses_without_end2end(run, policy):
    with pytest.raises(ConfigError, match=rf"pas_policy '{policy}' pipelines the whole model and needs "
                                          r"ComputeConfig\(use_end2end=True\)"):
        run(policy, plan=2, end2end=False, pipeline_nmicros=4, pipeline_pivots="Block")


@pytest.mark.parametrize("policy", ["hybrid", "pp"])
def test_zero_combines_with_a_pipeline(run, policy):
    graph = run(policy, plan=2, runtime=4, zero=True, pipeline_nmicros=4, pipeline_pivots="Block")
    assert graph.pipeline is not None and graph.pipeline.nstages == 2


@pytest.mark.parametrize("policy", ["hybrid", "pp"])
def test_takes_the_keys_every_plan_reads(run, policy):
    """use_zero=3's units, resharding and mixed precision (registry.COMMON_KEYS), read by the runtime."""
    graph = run(policy, plan=2, runtime=4, zero=3, pipeline_nmicros=4, pipeline_pivots="Block",
                zero3_units=["h.0"], zero3_reshard_after_forward=False,
                zero3_mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    assert graph.pipeline is not None and graph.pipeline.nstages == 2


@pytest.mark.parametrize("policy", ["hybrid", "pp"])
def test_refuses_unknown_keys(run, policy):
    with pytest.raises(ConfigError, match=rf"pas_policy '{policy}' does not know pas_config key\(s\) "
                                          r"'pipeline_stages', 'seed'; its keys are .*pipeline_nstages.*"
                                          r"\(prefix your own keys with '_'\)"):
        run(policy, plan=2, pipeline_nmicros=4, pipeline_stages=2, seed=1, _mine=3)


@pytest.mark.parametrize("policy", ["hybrid", "pp"])
def test_refuses_missing_nmicros(run, policy):
    with pytest.raises(ConfigError, match=rf"pas_policy '{policy}' needs pas_config\['pipeline_nmicros'\] "
                                          r"\(micro-batches per step\)"):
        run(policy, plan=2, pipeline_pivots="Block")


@pytest.mark.parametrize("bad", [0, -2, "4", True, 2.0, None])
def test_refuses_bad_nmicros(run, bad):
    with pytest.raises(ConfigError, match=r"pas_config\['pipeline_nmicros'\] must be an integer >= 1, got "):
        run(plan=2, pipeline_nmicros=bad, pipeline_pivots="Block")


@pytest.mark.parametrize("bad", ["pipedream", 5, None, "INFER_PIPE"])
def test_refuses_unknown_scheduler(run, bad):
    with pytest.raises(ConfigError, match=r"pas_config\['pipeline_scheduler'\] = .* is not a schedule; training: "
                                          r"1f1b, 1f1b_interleaved.*; inference: infer_pipe"):
        run(plan=2, pipeline_nmicros=4, pipeline_pivots="Block", pipeline_scheduler=bad)


@pytest.mark.parametrize("policy", ["hybrid", "pp"])
def test_refuses_infer_pipe_for_a_training_module(run, policy):
    with pytest.raises(ConfigError, match=r"pas_config\['pipeline_scheduler'\] = 'infer_pipe' runs forwards only, "
                                          r"but the module is built for training \(inference_only=False\): use a "
                                          r"training schedule .* or set inference_only=True"):
        run(policy, plan=2, pipeline_nmicros=4, pipeline_pivots="Block", pipeline_scheduler="infer_pipe")


def test_refuses_pivots_that_match_nothing(run):
    with pytest.raises(ConfigError, match=r"pipeline_pivots 'Layer' matches no module of gpt.GPT; its module "
                                          r"classes are: Block, "):
        run(plan=2, pipeline_nmicros=4, pipeline_pivots="Layer")


@pytest.mark.parametrize("bad", [5, ["Block", 3]])
def test_refuses_bad_pivot_types(run, bad):
    with pytest.raises(ConfigError, match=r"pipeline_pivots must be a comma-separated string of module class names"):
        run(plan=2, pipeline_nmicros=4, pipeline_pivots=bad)


# -- refused: one case per rule (policy, plan_ngpus, pas_config, message) ---------------------

B = {"pipeline_pivots": "Block"}
REFUSED = [
    pytest.param("hybrid", 2, dict(pipeline_nstages=1, **B),
                 r"pas_config\['pipeline_nstages'\] = 1 turns the pipeline off, so pipeline_pivots must not be "
                 r"set; remove it, or set pipeline_nstages > 1 or 'auto'", id="hybrid-nstages-1-with-pivots"),
    pytest.param("hybrid", 2, dict(pipeline_nstages=2),
                 r"pas_config\['pipeline_nstages'\] = 2 needs pipeline_pivots \(the module class names where "
                 r"stages may start, e.g. 'Block'\)", id="hybrid-nstages-2-without-pivots"),
    pytest.param("hybrid", 2, dict(pp_size=2),
                 r"pp_size \(2\) > 1 needs a pipeline: set pipeline_nstages \(and pipeline_pivots\)",
                 id="hybrid-pp_size-without-pipeline"),
    pytest.param("hybrid", 2, dict(pipeline_nstages=1, pp_size=2), r"pp_size \(2\) > 1 needs a pipeline: set "
                 r"pipeline_nstages", id="hybrid-pp_size-with-nstages-1"),
    pytest.param("hybrid", 2, dict(pp_size="2", **B), r"pas_config\['pp_size'\] must be an integer >= 1, got '2'",
                 id="hybrid-bad-pp_size-with-auto-nstages"),
    pytest.param("hybrid", 3, dict(pipeline_nstages=4, pp_size=3, **B),
                 r"pas_config\['pipeline_nstages'\] \(4\) must be a multiple of pp_size \(3\): every pipeline "
                 r"device holds the same number of stages", id="hybrid-nstages-not-multiple-of-pp_size"),
    pytest.param("hybrid", 4, dict(pipeline_nstages=2, pp_size=4, **B),
                 r"pas_config\['pipeline_nstages'\] \(2\) must be a multiple of pp_size \(4\)",
                 id="hybrid-pp_size-above-nstages"),
    pytest.param("hybrid", 6, dict(pipeline_nstages=4, pp_size=4, **B),
                 r"plan_ngpus \(6\) must be a multiple of pp_size \(4\): each pipeline device gets plan_ngpus // "
                 r"pp_size devices", id="hybrid-plan_ngpus-not-multiple-of-pp_size"),
    pytest.param("hybrid", 2, dict(pipeline_nstages=4, pp_size=2, **B),
                 r"pipeline_nstages \(4\) > pp_size \(2\) puts several stages on a device, which only "
                 r"pipeline_scheduler='1f1b_interleaved' runs; got '1f1b'", id="hybrid-stages-per-device-1f1b"),
    pytest.param("hybrid", 2, dict(pipeline_nstages=2, pipeline_scheduler="1f1b_interleaved", **B),
                 r"pipeline_scheduler='1f1b_interleaved' needs several stages per device: set pipeline_nstages to "
                 r"a multiple > 1 of pp_size \(2\), got 2", id="hybrid-interleaved-one-stage-per-device"),
    # "auto" picks one stage per pipeline device, which interleaving cannot run: say how many
    pytest.param("hybrid", 2, dict(pipeline_scheduler="1f1b_interleaved", **B),
                 r"'1f1b_interleaved' needs several stages per device: set pipeline_nstages",
                 id="hybrid-interleaved-auto-nstages"),
    pytest.param("hybrid", 2, dict(pipeline_nmicros=3, pipeline_nstages=4, pp_size=2,
                                   pipeline_scheduler="1f1b_interleaved", **B),
                 r"'1f1b_interleaved' needs nmicros \(pipeline_nmicros\) to be a multiple of ndevices \(pp_size\)",
                 id="hybrid-interleaved-nmicros"),
    pytest.param("hybrid", 2, dict(pipeline_nstages=2, pipeline_scheduler="chimera_direct", **B),
                 r"pipeline_scheduler='chimera_direct' needs nstages \(pipeline_nstages\) == 4",
                 id="hybrid-chimera-2-stages"),
    pytest.param("hybrid", 4, dict(pipeline_nmicros=3, pipeline_nstages=4, pipeline_scheduler="chimera_direct", **B),
                 r"'chimera_direct' needs an even nmicros \(pipeline_nmicros\)", id="hybrid-chimera-odd-nmicros"),
    pytest.param("hybrid", 6, dict(pipeline_nmicros=6, pipeline_nstages=6, **B),
                 r"cannot cut gpt.GPT into pipeline_nstages=6 stages: .* lower pipeline_nstages or give more "
                 r"pipeline_pivots", id="hybrid-more-stages-than-pivots"),
    pytest.param("pp", 4, dict(pp_size=2), r"pas_policy 'pp' puts one pipeline device on each plan device, so "
                 r"pp_size must equal plan_ngpus \(4\), got 2; use 'hybrid'", id="pp-pp_size"),
    pytest.param("pp", 1, dict(pipeline_nstages=1, **B), r"pas_config\['pipeline_nstages'\] = 1 turns the "
                 r"pipeline off, so pipeline_pivots must not be set", id="pp-nstages-1-with-pivots"),
    # pp has pp_size = plan_ngpus and tp_size 1: one stage cannot fill 2 pipeline devices
    pytest.param("pp", 2, dict(pipeline_nstages=1), r"pas_config\['pipeline_nstages'\] \(1\) must be a multiple "
                 r"of pp_size \(2\)", id="pp-nstages-1-on-2-devices"),
    pytest.param("pp", 2, dict(pipeline_nstages=4), r"pipeline_nstages \(4\) > pp_size \(2\) puts several stages "
                 r"on a device, which only pipeline_scheduler='1f1b_interleaved' runs", id="pp-stages-per-device"),
]


@pytest.mark.parametrize("policy,plan,pas,match", REFUSED)
def test_refused_configuration(run, policy, plan, pas, match):
    with pytest.raises(ConfigError, match=match):
        run(policy, plan=plan, **{"pipeline_nmicros": 4, **pas})


@pytest.mark.parametrize("policy", ["hybrid", "pp"])
@pytest.mark.parametrize("bad", [0, "two", "4", 2.5, True, None])
def test_refuses_bad_nstages(run, policy, bad):
    with pytest.raises(ConfigError, match=r"pas_config\['pipeline_nstages'\] must be an integer >= 1, got "):
        run(policy, plan=2, pipeline_nmicros=4, pipeline_nstages=bad, pipeline_pivots="Block")


@pytest.mark.parametrize("bad", [0, "2", True, 1.0])
def test_hybrid_refuses_bad_pp_size(run, bad):
    with pytest.raises(ConfigError, match=r"pas_config\['pp_size'\] must be an integer >= 1, got "):
        run(plan=2, pipeline_nmicros=4, pipeline_nstages=2, pipeline_pivots="Block", pp_size=bad)
