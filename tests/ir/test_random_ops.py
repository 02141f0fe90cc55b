"""The list of random ops (ir/random_ops.py) and ComputeConfig.rng_mode."""
from __future__ import annotations

import pytest
import torch

from nnscaler.ir.config import ComputeConfig, ConfigError
from nnscaler.ir.op_names import resolve
from nnscaler.ir.random_ops import LIKE, MASK, OTHER, RANDOM_OPS, random_kind
from nnscaler.ir.trace import trace


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
