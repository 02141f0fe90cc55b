"""Generated per-rank modules: readable, importing only what they may, mapping back to user lines."""
from __future__ import annotations

import ast
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler.codegen import GenerationError, generate
from nnscaler.codegen.emit import emit_rank
from nnscaler.codegen.render import Renderer
from nnscaler.ir import ComputeConfig, trace
from nnscaler.ir.graph import Ref
from nnscaler.policies import apply_policy, partition, replicate, select, assign

from gen_ast import assigned, calls, class_constant, dotted, method, names_in, producer
from gpt import GPT, GPTConfig, random_batch
from mode_models import TeacherStudent


def load(text: str, cls: str, model: nn.Module):
    """The generated class of a one-rank module, built and loaded with `model`'s weights."""
    namespace = {}
    exec(compile(text, "gencode0.py", "exec"), namespace)
    pm = namespace[cls](init_params=False)
    pm.load_full_state({**dict(model.named_parameters()), **dict(model.named_buffers())})
    return pm


class WithOptional(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask=None):
        y = self.fc(x)
        return y.sum() if mask is None else (y * mask).sum()


def planned(module, args, world=2, **cfg):
    config = ComputeConfig(1, world, trace_strategy="cpu", **cfg)
    graph = apply_policy(trace(module, args, constant_folding=config.constant_folding), config, "dp")
    return graph, config


def test_one_readable_module_per_rank(tmp_path):
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    graph, config = planned(GPT(cfg), random_batch(0, 2, cfg), world=3)
    paths = generate(graph, config, tmp_path, policy="dp")
    assert [p.name for p in paths] == ["gencode0.py", "gencode1.py", "gencode2.py"]
    text = paths[1].read_text()
    tree = ast.parse(text)
    imports = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imports |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imports == {"torch", "nnscaler.runtime"}
    assert "RANK = 1" in text and "class GPT(nr.ParallelModule)" in text
    # names follow the user's modules; the tied head is an alias, not a second tensor
    assert "'h_0_attn_q_proj_weight'" in text and "add_full_alias('lm_head.weight', 'wte_weight')" in text
    # every op is preceded by the user's source line
    assert f"# {os.path.basename(GPT.__module__)}.py:" in text or "# gpt.py:" in text
    assert "x = x + self.attn(self.ln_1(x))" in text


def test_source_map_points_at_statements_of_the_users_lines(tmp_path):
    graph, config = planned(WithOptional(), {"x": torch.ones(2, 4)}, world=1)
    text = emit_rank(graph, config.to_dict(), 0, "dp", graph.fingerprint())
    namespace = {}
    exec(compile(text, "gencode0.py", "exec"), namespace)
    source_map = namespace["WithOptional"].SOURCE_MAP
    lines = text.splitlines()
    assert source_map, "no source map"
    for lineno, where in source_map.items():
        assert f"{__file__}:" in where
        assert not lines[lineno - 1].strip().startswith("#")  # a statement, not the comment
    assert any("y = self.fc(x)" in w for w in source_map.values())


def test_untraced_optional_argument_is_refused_at_run_time(tmp_path):
    model = WithOptional()
    graph, config = planned(model, {"x": torch.ones(2, 4)}, world=1)
    text = emit_rank(graph, config.to_dict(), 0, "dp", graph.fingerprint())
    args = method(text, "_forward_impl").args
    assert [a.arg for a in args.args] == ["self", "x", "mask"] and ast.literal_eval(args.defaults[-1]) is None
    pm = load(text, "WithOptional", model)
    x = torch.randn(2, 4)
    assert torch.allclose(pm(x), model(x))  # the traced path (mask=None) runs
    with pytest.raises(TypeError, match="argument mask was not in dummy_forward_args"):
        pm(x, mask=torch.ones(2, 4))  # the untraced one is refused, not silently ignored


def test_dead_values_are_freed_and_shapes_recomputed_without_folding():
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    model = GPT(cfg)
    graph, config = planned(model, random_batch(0, 2, cfg), world=1)
    text = emit_rank(graph, config.to_dict(), 0, "dp", graph.fingerprint())
    forward = method(text, "_forward_impl")
    # every `del` frees a value that no later statement reads
    body = [s for s in ast.walk(forward) if isinstance(s, ast.stmt)]
    dels = [(i, t.id) for i, s in enumerate(body) if isinstance(s, ast.Delete) for t in s.targets]
    assert dels, "no value is freed"
    for i, name in dels:
        later = [n for s in body[i + 1:] if not isinstance(s, ast.Delete) for n in names_in(s)]
        assert name not in later, f"{name} is read after `del {name}`"
    # constant_folding=False: shapes come from the runtime tensors, so another batch size runs
    assert calls(forward, ".size"), "no shape is read at run time"
    pm = load(text, "GPT", model)
    other = random_batch(1, 3, cfg)  # traced with a batch of 2
    assert torch.allclose(pm(**other), model(**other), atol=1e-6)
    graph, config = planned(GPT(cfg), random_batch(0, 2, cfg), world=1, constant_folding=True)
    folded = method(emit_rank(graph, config.to_dict(), 0, "dp", graph.fingerprint()), "_forward_impl")
    assert not calls(folded, ".size")
    views = [[ast.literal_eval(a) for a in c.args] for c in calls(folded, ".view")
             if all(isinstance(a, ast.Constant) for a in c.args)]
    assert [2, 8, 2, 8] in views, views  # the traced shape, folded into the code


def test_partitioned_op_gets_sharded_weights_and_adapters():
    graph = trace(WithOptional(), {"x": torch.ones(2, 4)}, trace_strategy="cpu")
    for node in graph.nodes:
        for device, piece in enumerate(replicate(graph, node, 2)):
            assign(piece, device)
    fc = select(graph, op="linear")[0]
    for i, piece in enumerate(partition(graph, fc, "n", 2)):  # column-parallel
        assign(piece, i)
    text = emit_rank(graph, ComputeConfig(2, 4).to_dict(), 3, "x", "f")
    # rank 3 is plan device 1 of the second unit (ranks 2, 3); the weight rows 2..4 live here
    init = method(text, "__init__")
    (weight,) = [c for c in calls(init, "self.register_parameter") if ast.literal_eval(c.args[0]) == "fc_weight"]
    (empty,) = calls(weight, "torch.empty")
    assert ast.literal_eval(empty.args[0]) == (2, 4)
    (full_map,) = [c for c in calls(init, "self.add_full_map") if ast.literal_eval(c.args[0]) == "fc_weight"]
    keywords = {k.arg: ast.literal_eval(k.value) for k in full_map.keywords}
    assert ast.literal_eval(full_map.args[1]) == "fc.weight"
    assert keywords == {"full_shape": (4, 4), "slices": ((2, 4), (0, 4)), "value_split": (0, 1), "replicas": 1}
    # every unit's group, created on every rank (new_group is collective)
    (loop,) = [s for s in ast.walk(init) if isinstance(s, ast.For)]
    assert ast.literal_eval(loop.iter) == ((0, 1), (2, 3)) and calls(loop, "self.grid.group")
    # the data flow x -> grad_all_reduce (Megatron's f: partial input grads) -> linear -> all_gather
    # (the split output made whole for the replicated sum) -> the returned sum
    forward = method(text, "_forward_impl")
    (linear,) = calls(forward, "torch.nn.functional.linear")
    fed = producer(forward, dotted(linear.args[0]))
    assert isinstance(fed, ast.Call) and dotted(fed.func) == "nr.comm.grad_all_reduce"
    assert dotted(fed.args[0]) == "x" and ast.literal_eval(fed.keywords[0].value) == (2, 3)
    assert dotted(linear.args[1]) == "self.fc_weight"
    (gather,) = calls(forward, "nr.comm.all_gather")
    linear_out = next(n for n, v in assigned(forward).items() if v is linear)
    assert dotted(gather.args[0]) == linear_out
    assert {k.arg: ast.literal_eval(k.value) for k in gather.keywords} == {"dim": 1, "ranks": (2, 3)}
    gathered = next(n for n, v in assigned(forward).items() if v is gather)
    (ret,) = [s for s in ast.walk(forward) if isinstance(s, ast.Return)]
    assert dotted(producer(forward, dotted(ret.value)).func) == f"{gathered}.sum"


def test_ops_not_covering_the_unit_are_refused():
    graph = trace(WithOptional(), {"x": torch.ones(2, 4)}, trace_strategy="cpu")
    for node in graph.nodes:
        assign(replicate(graph, node, 1)[0], 0)
    with pytest.raises(GenerationError, match="every op must run on all 2 devices"):
        emit_rank(graph, ComputeConfig(2, 2).to_dict(), 0, "x", "f")


def test_renderer_constants_and_operators():
    r = Renderer({1: "a", 2: "b"})
    assert r.value(slice(None, Ref(2), 2), in_index=True) == ":b:2"
    assert r.call("torch.Tensor.__getitem__", [Ref(1), (Ellipsis, slice(None, 3, None), None)], {}) == "a[..., :3, None]"
    assert r.call("torch.Tensor.__add__", [Ref(1), 2], {}) == "(a + 2)"
    assert r.call("torch.Tensor.__rsub__", [Ref(1), 1.5], {}) == "(1.5 - a)"
    assert r.call("operator.floordiv", [Ref(1), Ref(2)], {}) == "(a // b)"
    assert r.call("torch.Tensor.view", [Ref(1), -1, Ref(2)], {}) == "a.view(-1, b)"
    assert r.call("torch.arange", [0, Ref(2)], {"dtype": torch.long, "device": torch.device("cpu")}) == \
        "torch.arange(0, b, dtype=torch.int64, device=self.device)"
    assert r.call("getattr", [Ref(1), "T"], {}) == "a.T"
    assert eval(r.value(-math.inf), {}) == -math.inf
    assert r.value(torch.Size([2, 3])) == "torch.Size([2, 3])"
    assert r.value({"k": (1,)}) == "{'k': (1,)}"


def test_parameter_names_never_shadow_module_attributes(tmp_path):
    class Clashing(nn.Module):
        def __init__(self):
            super().__init__()
            self.grid = nn.Parameter(torch.ones(3))
            self.device = nn.Parameter(torch.ones(3))
            self.rank = nn.Linear(3, 3)

        def forward(self, x):
            return (self.rank(x) * self.grid + self.device).sum()

    from nnscaler.codegen.emit import param_local_names
    graph, config = planned(Clashing(), {"x": torch.ones(2, 3)}, world=1)
    names = param_local_names(graph)
    assert names["grid"] != "grid" and names["device"] != "device" and names["rank.weight"] == "rank_weight"
    text = emit_rank(graph, config.to_dict(), 0, "dp", graph.fingerprint())
    namespace = {}
    exec(compile(text, "gencode0.py", "exec"), namespace)
    pm = namespace["Clashing"](init_params=False)
    model = Clashing()
    pm.load_full_state(dict(model.named_parameters()))
    assert torch.allclose(pm(torch.ones(2, 3)), model(torch.ones(2, 3)))


class ModeDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        h = F.dropout(self.bn(self.fc(x)), 0.1, self.training)
        return (h * (3.0 if self.training else 1.0)).sum()


def test_mode_dependent_ops_read_self_training(tmp_path):
    graph, config = planned(ModeDependent(), {"x": torch.randn(8, 4)}, world=1)
    text = generate(graph, config, tmp_path, policy="dp")[0].read_text()
    assert class_constant(text, "TRACED_TRAINING") is True and "MODE_DIVERGENCE" not in text
    forward = method(text, "_forward_impl")
    (bn,) = calls(forward, "torch.nn.functional.batch_norm")
    assert [dotted(k.value) for k in bn.keywords if k.arg == "training"] == ["self.training"]
    (dropout,) = calls(forward, "torch.nn.functional.dropout")  # (a substring test matched the comment)
    keywords = {k.arg: k.value for k in dropout.keywords}
    assert ast.literal_eval(keywords["p"]) == 0.1 and dotted(keywords["training"]) == "self.training"
    (choice,) = [n for n in ast.walk(forward) if isinstance(n, ast.IfExp) and dotted(n.test) == "self.training"]
    assert (ast.literal_eval(choice.body), ast.literal_eval(choice.orelse)) == (3.0, 1.0)
    # and it behaves so: in eval mode the module computes what the model computes
    model = ModeDependent()
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.running_var.uniform_(0.5, 2)
    pm = load(text, "ModeDependent", model)
    x = torch.randn(8, 4)
    assert torch.allclose(pm.eval()(x), model.eval()(x), atol=1e-6)
    guarded = text.index("        if self.training:\n            ")
    assert text[guarded:].split("\n")[1].strip().endswith("self.bn_num_batches_tracked.add_(1)")
    ast.parse(text)


class Rebinds(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        h = self.fc(x)
        self.ema = self.ema * 0.9 + h.detach().mean(0) * 0.1
        return (h * self.ema).sum()


def test_reassigned_buffer_is_rebound_and_a_split_one_refused(tmp_path):
    graph, config = planned(Rebinds(), {"x": torch.randn(8, 4)}, world=1)
    text = generate(graph, config, tmp_path / "dp", policy="dp")[0].read_text()
    (value,) = graph.buffer_updates.values()
    assert f"self.ema = {graph.value(value).name}_{value.id}" in text
    # tp (seed 1) splits both readers of ema on its only dim: the plan stores it split
    tp_cfg = ComputeConfig(2, 2, trace_strategy="cpu", pas_config={"seed": 1})
    split = apply_policy(trace(Rebinds(), {"x": torch.randn(8, 4)}), tp_cfg, "tp")
    with pytest.raises(GenerationError, match="reassigns buffer ema, which the plan stores split.*in place"):
        generate(split, tp_cfg, tmp_path / "tp", policy="tp")


def test_no_grad_and_autocast_regions_become_with_blocks(tmp_path):
    graph, config = planned(TeacherStudent(), {"x": torch.randn(8, 4)}, world=1)
    text = generate(graph, config, tmp_path, policy="dp")[0].read_text()
    ast.parse(text)
    body = text[text.index("def _forward_impl"):]
    assert body.count("with torch.no_grad():") == 1  # the three ops of the region share one block
    block = body[body.index("with torch.no_grad():"):].split("\n")[1:]
    inside = [line for line in block[:block.index(next(x for x in block if not x.startswith(" " * 12)))]]
    ops = [x for x in inside if not x.strip().startswith(("#", "del "))]
    assert len(ops) == 3 and ".linear(" in ops[0] and ".relu(" in ops[1] and " * 2)" in ops[2], inside
    assert "with torch.autocast('cpu', dtype=torch.bfloat16):" in body
    after = body[body.index("torch.autocast"):].split("\n")
    assert after[1].strip().startswith("linear_") and "float()" not in after[1] and "float()" in "\n".join(after[2:])


def test_layout_conversions_stay_outside_no_grad_blocks(tmp_path):
    config = ComputeConfig(2, 2, trace_strategy="cpu", pas_config={"seed": 1})
    graph = apply_policy(trace(TeacherStudent(), {"x": torch.randn(8, 4)}), config, "tp")
    text = generate(graph, config, tmp_path, policy="tp")[0].read_text()
    lines = text[text.index("def _forward_impl"):].split("\n")
    assert any("nr.comm." in line for line in lines) and any("with torch.no_grad():" in line for line in lines)
    for i, line in enumerate(lines):
        if "nr.comm." in line:  # a conversion is never the body of a `with` block
            assert not lines[i - 1].strip().startswith("with "), lines[i - 1:i + 1]
            assert len(line) - len(line.lstrip()) == 8, line


def test_a_replicated_weight_read_by_a_split_op_is_passed_as_a_view():
    """A weight the op reads whole while its input is split (data parallel inside the unit) enters
    through ``grad_all_reduce(..., weight=True)`` (a view, no copy a step; under ZeRO-3 the gathered
    tensor's view); an activation's ``grad_all_reduce`` has no such flag (a copy: in-place safe)."""
    graph = trace(WithOptional(), {"x": torch.ones(2, 4)}, trace_strategy="cpu")
    for node in graph.nodes:
        for device, piece in enumerate(replicate(graph, node, 2)):
            assign(piece, device)
    fc = select(graph, op="linear")[0]
    for i, piece in enumerate(partition(graph, fc, "n", 2)):  # column-parallel: the input x whole
        assign(piece, i)
    forward = method(emit_rank(graph, ComputeConfig(2, 2).to_dict(), 0, "x", "f"), "_forward_impl")
    (linear,) = calls(forward, "torch.nn.functional.linear")
    fed = producer(forward, dotted(linear.args[0]))
    assert dotted(fed.func) == "nr.comm.grad_all_reduce" and dotted(fed.args[0]) == "x"
    assert [k.arg for k in fed.keywords] == ["ranks"]  # an activation: copied
    graph = trace(WithOptional(), {"x": torch.ones(2, 4)}, trace_strategy="cpu")
    for node in graph.nodes:
        for device, piece in enumerate(replicate(graph, node, 2)):
            assign(piece, device)
    fc = select(graph, op="linear")[0]
    for i, piece in enumerate(partition(graph, fc, "b0", 2)):  # the batch: the weights whole
        assign(piece, i)
    forward = method(emit_rank(graph, ComputeConfig(2, 2).to_dict(), 0, "x", "f"), "_forward_impl")
    (linear,) = calls(forward, "torch.nn.functional.linear")
    for arg in linear.args[1:3]:  # the weight and the bias
        fed = producer(forward, dotted(arg))
        assert dotted(fed.func) == "nr.comm.grad_all_reduce" and dotted(fed.args[0]).startswith("self.fc_")
        assert {k.arg: ast.literal_eval(k.value) for k in fed.keywords}.get("weight") is True
