"""trace() in both modes: what differs between training and eval is recorded on the graph
(nnscaler.ir.tracer.modes), and the module is left as it was."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler.ir import IRGraph, trace

from mode_models import Branchy, DropNorm


X = {"x": torch.randn(8, 4)}


def _node(graph: IRGraph, suffix: str):
    return next(n for n in graph.nodes if n.target.endswith(suffix))


def test_mode_dependent_constants_and_training_only_ops():
    g = trace(DropNorm(), X)
    assert g.traced_training is True and g.mode_divergence is None
    assert _node(g, "dropout").mode_args == [["kwargs", "training", True, False]]
    assert _node(g, "batch_norm").mode_args == [["kwargs", "training", True, False]]
    mul = _node(g, "__mul__") if any(n.target.endswith("__mul__") for n in g.nodes) else _node(g, "mul")
    assert mul.mode_args == [["args", 1, 2.0, 0.5]]
    adds = [n for n in g.nodes if n.inplace]
    assert [(n.module_path, n.only_when) for n in adds] == [("", None), ("bn", True)]  # calls: both modes


def test_traced_in_eval_mode_orients_values_by_mode():
    m = DropNorm().eval()
    g = trace(m, X)
    assert g.traced_training is False and g.mode_divergence is None
    assert _node(g, "dropout").mode_args == [["kwargs", "training", True, False]]
    # the eval trace has no num_batches_tracked update: it is copied in from the training trace
    counter = [n for n in g.nodes if n.only_when is not None]
    assert [(n.module_path, n.target, n.only_when) for n in counter] == [("bn", "torch.Tensor.add_", True)]
    assert g.nodes.index(counter[0]) == g.nodes.index(_node(g, "batch_norm")) - 1
    assert g.value(counter[0].outputs).shape == () and counter[0].id not in {n.id for n in g.nodes if n is not counter[0]}
    assert IRGraph.from_json(g.to_json()).fingerprint() == g.fingerprint()


def test_python_branch_on_training_is_a_divergence_naming_the_users_line():
    g = trace(Branchy(), X)
    assert g.mode_divergence is not None
    assert "mode_models.py" in g.mode_divergence and "h = torch.tanh(h)" in g.mode_divergence
    assert all(n.mode_args == [] and n.only_when is None for n in g.nodes)


def test_modules_without_mode_dependence_are_unannotated():
    g = trace(nn.Sequential(nn.Linear(4, 4), nn.GELU()), {"input": X["x"]})
    assert g.mode_divergence is None
    assert all(n.mode_args == [] and n.only_when is None for n in g.nodes)


def test_flags_buffers_and_rng_are_left_as_they_were():
    m = DropNorm()
    m.bn.eval()  # a mixed-mode model: every module's own flag comes back
    flags = [mod.training for mod in m.modules()]
    state = {k: v.clone() for k, v in m.state_dict().items()}
    rng = torch.get_rng_state()
    trace(m, X)
    assert [mod.training for mod in m.modules()] == flags
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in state.items())
    assert torch.equal(rng, torch.get_rng_state())


def test_forward_failing_in_the_other_mode_is_a_divergence():
    class TrainOnly(nn.Module):
        def forward(self, x):
            if not self.training:
                raise RuntimeError("eval is not supported")
            return x.sum()
    g = trace(TrainOnly(), X)
    assert "fails in eval mode" in g.mode_divergence and "eval is not supported" in g.mode_divergence


def test_both_modes_false_traces_once():
    class Counting(nn.Module):
        calls = 0

        def forward(self, x):
            Counting.calls += 1
            return F.dropout(x, 0.5, self.training).sum()
    g = trace(Counting(), X, both_modes=False)
    assert Counting.calls == 1 and _node(g, "dropout").mode_args == []
    trace(Counting(), X)
    assert Counting.calls == 3


def test_json_round_trip_and_fingerprint_keep_the_modes():
    g = trace(DropNorm(), X)
    back = IRGraph.from_json(g.to_json())
    assert [(n.mode_args, n.only_when) for n in back.nodes] == [(n.mode_args, n.only_when) for n in g.nodes]
    assert back.traced_training is True and back.fingerprint() == g.fingerprint()
    assert trace(DropNorm(), X, both_modes=False).fingerprint() != g.fingerprint()
    div = trace(Branchy(), X)
    assert IRGraph.from_json(div.to_json()).mode_divergence == div.mode_divergence


def test_buffer_reassigned_in_one_mode_only_is_a_divergence():
    class Ema(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("ema", torch.zeros(4))

        def forward(self, x):
            new = self.ema * 0.9 + x.mean(0) * 0.1
            if self.training:  # the same ops in both modes, but eval does not keep the result
                self.ema = new
            return (x * new).sum()

    g = trace(Ema(), X)
    assert g.mode_divergence is not None and "reassigns buffers ['ema'] in training mode" in g.mode_divergence
    assert list(g.buffer_updates) == ["ema"]


def test_same_op_on_other_arguments_is_described_as_such():
    class Swap(nn.Module):
        def forward(self, x):
            y = x * 2
            return (y * x if self.training else y * y).sum()

    g = trace(Swap(), X)
    assert "runs torch.Tensor.mul on other arguments in training mode than in eval mode" in g.mode_divergence
