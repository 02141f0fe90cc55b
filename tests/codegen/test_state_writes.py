"""In-place updates of parameters in forward: when the plan runs the op on a converted copy, the
generated code copies the result back into the stored parameter (codegen/state_writes.py)."""
from __future__ import annotations

import ast

import torch
import torch.nn as nn

from nnscaler.codegen.emit import emit_rank
from nnscaler.ir import ComputeConfig, trace
from nnscaler.policies import apply_policy


class MaxNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        with torch.no_grad():
            self.fc1.weight.div_(self.fc1.weight.norm(dim=1, keepdim=True) * 2)
        return self.fc2(torch.relu(self.fc1(x))).sum()


def _writes(policy, plan):
    """(receiver, argument) of every `<x>.copy_(<y>)` call in rank 0's forward."""
    config = ComputeConfig(plan, plan, trace_strategy="cpu")
    graph = apply_policy(trace(MaxNorm(), {"x": torch.randn(4, 8)}), config, policy)
    tree = ast.parse(emit_rank(graph, config.to_dict(), 0, "x", "f"))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    return [(ast.unparse(c.func.value), ast.unparse(c.args[0])) for c in calls if c.func.attr == "copy_"]


def test_update_of_a_converted_copy_is_written_back_whole():
    writes = _writes("tp", 2)
    assert len(writes) == 1 and writes[0][0] == "self.fc1_weight"
    assert "all_gather" in writes[0][1]  # the split result made whole again, as the parameter is stored


def test_update_in_the_stored_layout_needs_no_write_back():
    assert _writes("dp", 1) == []
