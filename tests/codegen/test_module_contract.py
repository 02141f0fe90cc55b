"""The generated module keeps the ir contract: its class attributes are the declared ones, in the
declared order, and typed where the contract says so; a recompute group's function takes exactly
the variables it reads from the enclosing forward."""
from __future__ import annotations

import ast
import builtins

import pytest
import torch

from gpt import GPT, GPTConfig, random_batch
from nnscaler.codegen import generate
from nnscaler.ir import ComputeConfig, trace
from nnscaler.ir.contracts import GENERATED_ATTR_NAMES, GENERATED_ATTRS, PipelineMeta, gencode_file
from nnscaler.policies import apply_policy

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _generate(tmp_path, policy, plan, world=None, **pas):
    torch.manual_seed(0)
    graph = trace(GPT(CFG), random_batch(0, 4, CFG))
    cfg = ComputeConfig(plan, world or plan, trace_strategy="cpu", use_end2end=True, pas_config=pas)
    return generate(apply_policy(graph, cfg, policy), cfg, tmp_path, policy=policy)


def _class(text: str) -> ast.ClassDef:
    return next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef))


@pytest.mark.parametrize("policy,plan,pas", [("dp", 1, {}), ("megatron", 2, {}),
                                             ("pp", 2, {"pipeline_nmicros": 2})])
def test_class_attributes_follow_the_contract(tmp_path, policy, plan, pas):
    paths = _generate(tmp_path, policy, plan, **pas)
    assert [p.name for p in paths] == [gencode_file(r) for r in range(plan)]
    order = [a.name for a in GENERATED_ATTRS]
    for path in paths:
        cls = _class(path.read_text())
        written = [a.targets[0].id for a in cls.body if isinstance(a, ast.Assign)]
        assert set(written) <= GENERATED_ATTR_NAMES
        assert written == sorted(written, key=order.index)
        assert {"COMPUTE_CONFIG", "RANK", "GRAPH_FINGERPRINT", "TRACED_TRAINING", "SOURCE_MAP"} <= set(written)
        assert ("PIPELINE" in written) == (policy == "pp")


def test_pipeline_literal_becomes_pipeline_meta(tmp_path):
    paths = _generate(tmp_path, "pp", 2, pipeline_nmicros=2)
    metas = []
    for path in paths:
        namespace: dict = {}
        exec(compile(path.read_text(), str(path), "exec"), namespace)  # defines the class only
        metas.append(namespace["GPT"].PIPELINE)
    assert all(isinstance(m, PipelineMeta) for m in metas) and metas[0] == metas[1]
    meta = metas[0]
    assert (meta.nstages, meta.nmicros, meta.pp_size) == (2, 2, 2)
    assert meta.loss in meta.outputs[1] and all(meta.producer[v] == 0 for v in meta.inputs[1])


def test_recompute_functions_take_the_variables_they_read(tmp_path):
    paths = _generate(tmp_path, "megatron", 2, recompute_modules="Block")
    for path in paths:
        forward = next(f for f in _class(path.read_text()).body
                       if isinstance(f, ast.FunctionDef) and f.name == "_forward_impl")
        segments = [f for f in forward.body if isinstance(f, ast.FunctionDef)]
        assert len(segments) == CFG.n_layer
        for fn in segments:
            params = {a.arg for a in fn.args.args}
            reads = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            local = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            outer = reads - local - params - {"self", "torch", "nr"} - set(dir(builtins))
            assert not outer, f"{fn.name} reads {outer} from the enclosing forward without taking them"
            assert params <= reads, f"{fn.name} takes {params - reads} it never reads"
