"""Random ops in generated code (codegen/random_streams.py): which statements draw from a split
stream, which are drawn at their full shape (exact mode), and what the exact mode refuses."""
from __future__ import annotations

import ast
import os
import sys

import pytest
import torch
import torch.nn as nn

from nnscaler.codegen import GenerationError
from nnscaler.codegen.emit import emit_rank
from nnscaler.ir import ComputeConfig, trace
from nnscaler.policies import apply_policy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "runtime"))
import random_models  # noqa: E402
from gen_ast import calls, class_constant, dotted, method, producer  # noqa: E402

def _made_by(forward, arg) -> str:
    """The callee that produced the value `arg` names ('' when not a call, e.g. an addition)."""
    made = producer(forward, dotted(arg))
    return dotted(made.func) if isinstance(made, ast.Call) else ""


SPLIT_PRODUCERS = {"torch.softmax", "torch.nn.functional.softmax", "torch.nn.functional.gelu"}


def _code(policy, plan, world, rank=0, model=None, args=None, **cfg):
    config = ComputeConfig(plan, world, trace_strategy="cpu", **cfg)
    model = model or random_models.make()
    args = args or random_models.batch(0, 4)
    graph = apply_policy(trace(model, args), config, policy)
    return emit_rank(graph, config.to_dict(), rank, policy, "fp")


def _line_after(code, needle):
    """The first statement after the comment naming `needle`, past layout conversions."""
    lines = code.splitlines()
    start = next(i for i, line in enumerate(lines) if needle in line) + 1
    return next(line.strip() for line in lines[start:] if "nr.comm." not in line)


def test_parallel_mode_splits_the_stream_only_for_split_outputs():
    code = _code("megatron", 2, 2)
    assert class_constant(code, "RANDOM") == {"mode": "parallel", "ops": 9}  # 2 blocks x 4 + the embedding dropout
    forward = method(code, "_forward_impl")
    dropouts = calls(forward, "torch.nn.functional.dropout")
    assert len(dropouts) == 9
    streams = [w for w in ast.walk(forward) if isinstance(w, ast.With)
               and [ast.unparse(i.context_expr) for i in w.items] == ["nr.random.shard_stream(self, 2)"]]
    assert len(streams) == 4  # attention probabilities and MLP hidden, per block
    in_stream = set()
    for w in streams:  # each stream wraps exactly one dropout, of a value split across the unit
        (drop,) = calls(w, "torch.nn.functional.dropout")
        in_stream.add(id(drop))
        assert _made_by(forward, drop.args[0]) in SPLIT_PRODUCERS
    for drop in dropouts:  # every other dropout draws from the unit's stream as is: a replicated input
        if id(drop) not in in_stream:
            assert _made_by(forward, drop.args[0]) not in SPLIT_PRODUCERS
    assert len(calls(forward, "nr.random.shard_stream")) == 4  # and no stream is entered elsewhere


def test_data_parallel_only_needs_no_rewrite():
    code = _code("dp", 1, 2)
    assert "nr.random" not in code and "RANDOM = {'mode': 'parallel', 'ops': 9}" in code


def test_exact_mode_draws_at_the_full_shape_and_keeps_the_piece():
    code = _code("megatron", 2, 2, rng_mode="exact")
    line = _line_after(code, "(h.0.attn.attn_drop)")
    assert line.startswith("dropout_") and " = softmax_" in line
    assert "nr.random.piece(self, torch.nn.functional.dropout(nr.random.full_ones(self, softmax_" in line
    assert line.endswith("shard=(1, 2), batch=False)")
    # replicated values without data parallelism: the whole draw, unchanged
    assert "nr.random" not in _line_after(code, "(h.0.attn.resid_drop)")
    dp = _code("dp", 1, 2, rng_mode="exact")
    assert dp.count("batch=True)") == 2 * 9 and "shard=None" in dp


class RandShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        noise = torch.rand(x.shape)  # the line the error must name
        return (self.fc(x) + noise).sum()


def test_exact_mode_refuses_what_it_cannot_reproduce_naming_the_users_line():
    x = torch.randn(4, 4)
    assert "torch.rand(" in _code("dp", 1, 1, model=RandShape(), args={"x": x}, rng_mode="exact")
    with pytest.raises(GenerationError) as err:
        _code("dp", 1, 2, model=RandShape(), args={"x": x}, rng_mode="exact")
    msg = str(err.value)
    assert "torch.rand at " in msg and "test_random_streams.py" in msg and "noise = torch.rand(x.shape)" in msg
    assert "data-parallel" in msg and "rng_mode='parallel'" in msg
    # the parallel mode runs it (each replica its own noise)
    assert "torch.rand(" in _code("dp", 1, 2, model=RandShape(), args={"x": x})


def test_exact_mode_refuses_pipelines():
    pas = {"pipeline_nmicros": 2, "pipeline_scheduler": "1f1b"}
    with pytest.raises(GenerationError, match="rng_mode='exact' does not support pipelined plans.*random_models.py"):
        _code("pp", 2, 2, rng_mode="exact", use_end2end=True, pas_config=pas)
    assert "RANDOM = {'mode': 'parallel'" in _code("pp", 2, 2, use_end2end=True, pas_config=pas)


def test_a_model_without_random_ops_gets_no_random_attribute():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x).sum()

    code = _code("tp", 2, 2, model=Plain(), args={"x": torch.randn(4, 4)}, rng_mode="exact")
    assert "RANDOM" not in code and "nr.random" not in code


class InplaceDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5, inplace=True)

    def forward(self, x):
        return self.drop(self.fc(x)).sum()


def test_exact_mode_keeps_an_inplace_dropout_inplace():
    code = _code("dp", 1, 2, model=InplaceDrop(), args={"x": torch.randn(4, 4)}, rng_mode="exact")
    line = _line_after(code, "(drop)")
    assert ".mul_(nr.random.piece(self, torch.nn.functional.dropout(nr.random.full_ones(" in line
    assert "inplace=False)" in line and "batch=True)" in line


class SdpaDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(8, 8)

    def forward(self, x):
        q = self.q_proj(x).view(2, 4, 4, 2).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1).sum()


def test_attention_dropout_split_by_heads_draws_per_piece_and_exact_mode_refuses_it():
    args = {"x": torch.randn(2, 4, 8)}
    code = _code("megatron", 2, 2, model=SdpaDropout(), args=args, pas_config={"column": ["q_proj"], "row": []})
    lines = code.splitlines()
    at = next(i for i, line in enumerate(lines)
              if "scaled_dot_product_attention(" in line and not line.strip().startswith("#"))
    assert lines[at - 1].strip() == "with nr.random.shard_stream(self, 2):"
    with pytest.raises(GenerationError, match="scaled_dot_product_attention at .*its output is split over 2 devices"):
        _code("megatron", 2, 2, model=SdpaDropout(), args=args, pas_config={"column": ["q_proj"], "row": []},
              rng_mode="exact")
