"""The list of random ops (ir/ops/random_ops.py) and ComputeConfig.rng_mode."""
from __future__ import annotations

import pytest
import torch

from nnscaler.ir.config import ComputeConfig, ConfigError
from nnscaler.ir.ops.op_names import resolve
from nnscaler.ir.ops.random_ops import LIKE, MASK, OTHER, RANDOM_OPS, random_kind
from nnscaler.ir.tracer.trace import trace


def test_every_listed_op_exists_in_torch():
    for target in RANDOM_OPS:
        assert callable(resolve(target)), target


def test_kinds():
    assert random_kind("torch.nn.functional.dropout") == MASK
    assert random_kind("torch.nn.functional.dropout2d") == MASK
    assert random_kind("torch.randn_like") == LIKE
    assert random_kind("torch.Tensor.uniform_") == OTHER
    assert random_kind("torch.nn.functional.alpha_dropout") == OTHER
    assert random_kind("torch.nn.functional.gelu") is None


def test_traced_random_ops_are_recognised():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.1)

        def forward(self, x):
            return self.drop(x) + torch.rand_like(x) + torch.bernoulli(torch.full_like(x, 0.5))

    graph = trace(M(), {"x": torch.randn(2, 3)})
    kinds = [random_kind(n.target) for n in graph.nodes if random_kind(n.target)]
    assert kinds == [MASK, LIKE, OTHER]


def test_rng_mode_is_checked():
    assert ComputeConfig(1, 1).rng_mode == "parallel"
    assert ComputeConfig(1, 1, rng_mode="exact").to_dict()["rng_mode"] == "exact"
    with pytest.raises(ConfigError, match=r"ComputeConfig.rng_mode must be one of 'parallel', 'exact', got 'exakt'"):
        ComputeConfig(1, 1, rng_mode="exakt")
    with pytest.raises(ConfigError, match="ComputeConfig.rng_mode must be str"):
        ComputeConfig(1, 1, rng_mode=None)


def test_attention_with_dropout_is_random_only_when_dropout_p_is_not_zero():
    import torch.nn.functional as F
    from nnscaler.ir.ops.random_ops import node_random_kind

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            q = self.fc(x).view(2, 4, 4, 2).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1 if self.training else 0.0)
            b = F.scaled_dot_product_attention(q, q, q, None, 0.2)
            c = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            return a.sum() + b.sum() + c.sum()

    graph = trace(Attn(), {"x": torch.randn(2, 4, 8)})
    sdpa = [n for n in graph.nodes if n.target.endswith("scaled_dot_product_attention")]
    assert [node_random_kind(n) for n in sdpa] == [OTHER, OTHER, None]
    graph = trace(Attn().eval(), {"x": torch.randn(2, 4, 8)})  # 0.0 when traced, 0.1 in training
    assert node_random_kind([n for n in graph.nodes if n.target.endswith("attention")][0]) == OTHER
