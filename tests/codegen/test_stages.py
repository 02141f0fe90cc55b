"""Staged code generation: what crosses stages, who holds which tensor, per-stage methods."""
from __future__ import annotations

import ast

import pytest
import torch
import torch.nn as nn

from nnscaler.codegen import GenerationError, generate
from nnscaler.codegen.stages import holding_groups, loss_value, shared_holders, stage_io
from nnscaler.ir import ComputeConfig, trace
from nnscaler.policies import apply_policy, assign, replicate, schedule, stage

from gpt import GPT, GPTConfig, random_batch

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)


def gpt_graph(plan=2, world=None, **pas):
    torch.manual_seed(0)
    graph = trace(GPT(CFG), random_batch(0, 4, CFG))
    cfg = ComputeConfig(plan, world or plan, use_end2end=True, pas_config={"pipeline_nmicros": 4, **pas})
    return apply_policy(graph, cfg, pas.pop("_policy", "pp")), cfg


class ShapeAcross(nn.Module):
    """Stage 1 reads an int (a size) made in stage 0."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        n = x.size(0)
        h = self.a(x)
        return self.b(h).view(n, -1).sum()


def manual_pipeline(module, args, leads, nstages=2):
    graph = trace(module, args)
    stage(graph, leads)
    schedule(graph, nmicros=2, scheduler="1f1b", pp_size=nstages, tp_size=1)
    for node in graph.nodes:
        for piece in replicate(graph, node, 1):
            assign(piece, node.stage)
    return graph


def test_gpt_two_stages_send_one_activation_and_the_loss():
    graph, _ = gpt_graph(2)
    io = stage_io(graph)
    assert len(io.inputs[1]) == 1 and io.inputs[0] == []
    (act,) = io.inputs[1]
    assert io.outputs[0] == [act] and io.producer[act] == 0 and io.consumers[act] == [1]
    loss = loss_value(graph)
    assert io.outputs[1] == [loss] and io.consumers[loss] == [] and io.kinds[loss] == "tensor"


def test_tied_embedding_is_held_by_both_end_stages_and_summed():
    graph, _ = gpt_graph(4)
    holders = shared_holders(graph)
    assert set(holders) == {"wte.weight"}
    assert holders["wte.weight"] == [(0, 3)]
    groups = holding_groups(graph)
    assert groups[graph.params["h.1.ln_1.weight"].value.id] == [1]


def test_chimera_holds_every_stage_on_two_devices():
    graph, _ = gpt_graph(4, pipeline_scheduler="chimera_direct")
    holders = shared_holders(graph)
    assert holders["h.0.ln_1.weight"] == [(0, 3)]
    assert holders["h.2.ln_1.weight"] == [(1, 2)]


def test_ints_cross_stages():
    torch.manual_seed(0)
    args = {"x": torch.randn(3, 4)}
    graph = manual_pipeline(ShapeAcross(), args,
                            leads=[next(i for i, n in enumerate(trace(ShapeAcross(), args).nodes)
                                        if n.module_path == "b")])
    io = stage_io(graph)
    kinds = sorted(io.kinds[v] for v in io.inputs[1])
    assert kinds == ["int", "tensor"]


def test_each_rank_defines_only_its_stages_and_the_same_pipeline(tmp_path):
    graph, cfg = gpt_graph(2, pipeline_nstages=4, pipeline_scheduler="1f1b_interleaved")
    paths = generate(graph, cfg, tmp_path)
    metas = []
    for rank, path in enumerate(paths):
        tree = ast.parse(path.read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef))
        methods = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
        assert {m for m in methods if m.startswith("_stage_")} == {f"_stage_{rank}", f"_stage_{rank + 2}"}
        assert "_pipeline_output" in methods and "_forward_impl" not in methods
        meta = next(a.value for a in cls.body if isinstance(a, ast.Assign) and a.targets[0].id == "PIPELINE")
        metas.append(ast.literal_eval(meta))
    assert metas[0] == metas[1] and metas[0]["nstages"] == 4 and metas[0]["pp_size"] == 2


def test_stage_registers_only_the_tensors_it_uses(tmp_path):
    graph, cfg = gpt_graph(2)
    first, last = (p.read_text() for p in generate(graph, cfg, tmp_path))
    assert "'h.0.attn.q_proj.weight'" in first and "'h.0.attn.q_proj.weight'" not in last
    assert "'ln_f.weight'" in last and "'ln_f.weight'" not in first
    assert "'wte.weight'" in first and "'wte.weight'" in last  # tied head: both ends


def test_crossing_values_keep_the_producer_layout_with_tensor_parallel_stages(tmp_path):
    graph, cfg = gpt_graph(4, _policy="hybrid", pipeline_nstages=2, pipeline_pivots="Block", pp_size=2)
    text = generate(graph, cfg, tmp_path)[2].read_text()
    stage1 = text[text.index("def _stage_1"):]
    first_op = stage1.splitlines()[2]
    assert "= _acts" in stage1.splitlines()[1] and "nr.comm" not in first_op  # no gather/split at the cut


def test_pipelined_forward_must_return_computed_values(tmp_path):
    class ReturnsInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x)).sum(), x

    m = ReturnsInput()
    nodes = trace(m, {"x": torch.randn(2, 4)}).nodes
    graph = manual_pipeline(m, {"x": torch.randn(2, 4)}, [next(i for i, n in enumerate(nodes) if n.module_path == "b")])
    with pytest.raises(GenerationError, match="returns x as is"):
        generate(graph, ComputeConfig(2, 2, use_end2end=True), tmp_path)


def test_op_off_its_stage_devices_is_refused(tmp_path):
    graph, cfg = gpt_graph(2)
    graph.nodes[-1].pieces[0].device = 0  # the loss belongs to stage 1 (device 1)
    with pytest.raises(GenerationError, match="stage 1"):
        generate(graph, cfg, tmp_path)


def test_arguments_are_checked_once_per_sample_not_in_each_stage(tmp_path):
    class Optional(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, mask=None):
            h = self.b(self.a(x))
            return (h if mask is None else h * mask).sum()

    m = Optional()
    nodes = trace(m, {"x": torch.randn(2, 4)}).nodes
    graph = manual_pipeline(m, {"x": torch.randn(2, 4)}, [next(i for i, n in enumerate(nodes) if n.module_path == "b")])
    text = generate(graph, ComputeConfig(2, 2, use_end2end=True), tmp_path)[0].read_text()
    methods = {f.name: ast.get_source_segment(text, f) for f in ast.walk(ast.parse(text)) if isinstance(f, ast.FunctionDef)}
    assert "def _check_sample(self, x, mask=None):" in methods["_check_sample"]
    assert "if mask is not None:" in methods["_check_sample"] and "argument mask was not in dummy_forward_args" in text
    assert all("mask is not None" not in body for name, body in methods.items() if name.startswith("_stage_"))


def test_pipelined_forward_reassigning_a_buffer_is_refused(tmp_path):
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.register_buffer("steps", torch.zeros(()))

        def forward(self, x):
            self.steps = self.steps + 1
            return self.b(self.a(x)).sum()

    m = Counter()
    nodes = trace(m, {"x": torch.randn(2, 4)}).nodes
    graph = manual_pipeline(m, {"x": torch.randn(2, 4)}, [next(i for i, n in enumerate(nodes) if n.module_path == "b")])
    with pytest.raises(GenerationError, match=r"reassigns buffer\(s\) steps.*pipelined.*in place"):
        generate(graph, ComputeConfig(2, 2, use_end2end=True), tmp_path)
