"""The `tp` policy (policies/builtin/tp.py): random splits, except an in-place write through a view
(DeepSeek-V3's attention: ``key = k.new_empty(...); key[..., :8].copy_(k_pass)``), its views and
their base, which stay replicated (`written_through_views`): split, the write went to a piece of a
converted copy and the attention read uninitialised memory (tp on DeepSeek-V3 was 4e-5 off one
process at the first step in float64)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from nnscaler.ir import ComputeConfig, trace
from nnscaler.policies import apply_policy
from nnscaler.policies.builtin._spread import written_through_views


class FillsSlices(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        key = h.new_zeros(4, 6, 16)
        key[..., :8].copy_(h)
        key[..., 8:].copy_(h * 2)
        return (key * key).sum()


def _graph():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace(FillsSlices(), {"x": torch.randn(4, 6, 8)})


def test_written_through_views_finds_the_write_its_views_and_their_base():
    graph = _graph()
    pinned = {n.target for n in graph.nodes if n.id in written_through_views(graph)}
    assert pinned == {"torch.Tensor.new_zeros", "torch.Tensor.__getitem__", "torch.Tensor.copy_"}
    assert not any(n.target == "torch.nn.functional.linear" for n in graph.nodes if n.id in written_through_views(graph))


@pytest.mark.parametrize("seed", range(1, 9))
def test_tp_keeps_a_write_through_a_view_replicated(seed):
    graph = apply_policy(_graph(), ComputeConfig(2, 2, trace_strategy="cpu", pas_config={"seed": seed}), "tp")
    pinned = written_through_views(graph)
    assert pinned
    for node in graph.nodes:
        if node.id in pinned:
            assert node.pieces[0].is_replicated(), (seed, node.describe())
    assert any(not n.pieces[0].is_replicated() for n in graph.nodes if n.id not in pinned), seed  # tp still splits
