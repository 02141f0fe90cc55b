"""What surrounds the traced ops (nnscaler.ir.tracer.trace_state): the model is left as it was (buffers,
attributes, RNG), buffers rebound in forward are recorded, each op keeps its grad mode and
autocast region, and what runs only while tracing (hooks, attribute updates) is reported."""
import os
import warnings

import pytest
import torch
import torch.nn as nn

from nnscaler.ir import IRGraph, TraceError, trace


def test_batchnorm_running_stats_restored_in_train_mode():
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    g = trace(m, {"input": torch.randn(8, 4) * 5 + 3})
    bn = next(n for n in g.nodes if n.target.endswith("batch_norm"))
    assert bn.kwargs["training"] is True and bn.module_path == "1"
    assert any(n.target == "torch.Tensor.add_" for n in g.nodes)  # num_batches_tracked += 1
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert m.training
    m(torch.randn(8, 4) * 5 + 3)  # a real forward does change them (the check above can fail)
    assert not torch.equal(before["1.running_mean"], m.state_dict()["1.running_mean"])


def test_rebound_buffer_restored():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("steps", torch.zeros(()))

        def forward(self, x):
            self.steps = self.steps + 1
            return x * self.steps

    m = Counter()
    original = m.steps
    g = trace(m, {"x": torch.randn(2)})
    assert m.steps is original and m.steps.item() == 0
    # the rebinding itself is part of the program: the buffer's new value is kept alive and named
    (name, ref), = g.buffer_updates.items()
    add = next(n for n in g.nodes if n.target.endswith("__add__") or n.target.endswith(".add"))
    assert name == "steps" and ref == add.outputs
    back = IRGraph.from_json(g.to_json())
    assert back.buffer_updates == g.buffer_updates and back.fingerprint() == g.fingerprint()


def test_buffer_set_to_something_else_than_a_tensor_is_refused():
    class Drops(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", torch.zeros(2))

        def forward(self, x):
            self.cache = None
            return x.sum()

    m = Drops()
    with pytest.raises(TraceError, match="forward sets buffer cache to NoneType.*must stay a tensor"):
        trace(m, {"x": torch.randn(2)})
    assert torch.equal(m.cache, torch.zeros(2))


def test_rng_state_and_params_unchanged():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.l(x)) + torch.rand(4)

    m = Noisy().eval()
    params = {k: v.clone() for k, v in m.named_parameters()}
    x = torch.randn(2, 4)
    state = torch.get_rng_state()
    expected = torch.rand(5)
    torch.set_rng_state(state)
    trace(m, {"x": x})
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(torch.rand(5), expected)
    assert all(torch.equal(p, params[k]) and p.grad is None for k, p in m.named_parameters())
    assert not m.training


def test_grad_mode_and_autocast_regions_are_recorded():
    from mode_models import TeacherStudent

    g = trace(TeacherStudent(), {"x": torch.randn(2, 4)})
    by_module = {(n.module_path, n.target.rsplit(".", 1)[-1]): (n.grad_enabled, n.autocast) for n in g.nodes}
    assert by_module[("teacher", "linear")] == (False, None)
    assert by_module[("", "relu")] == (False, None) and by_module[("", "mul")] == (False, None)
    assert by_module[("student", "linear")] == (True, ["cpu", "bfloat16"])
    assert g.value(next(n for n in g.nodes if n.module_path == "student").outputs).dtype == "bfloat16"
    assert all(n.grad_enabled and n.autocast is None for n in g.nodes if n.target.endswith(("float", "mean")))
    back = IRGraph.from_json(g.to_json())
    assert [(n.grad_enabled, n.autocast) for n in back.nodes] == [(n.grad_enabled, n.autocast) for n in g.nodes]


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


@pytest.mark.parametrize("reentrant", [True, False])
def test_ops_inside_checkpoint_and_autograd_functions_keep_the_callers_grad_mode(reentrant):
    """torch runs an autograd.Function's forward (a reentrant checkpoint's too) with grad off:
    that is not the user's torch.no_grad(), so the ops must not be recorded as such."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            h = checkpoint(lambda t: torch.relu(self.a(t)), x, use_reentrant=reentrant)
            with torch.no_grad():
                frozen = Scale.apply(self.b(x))
            return (Scale.apply(self.b(h)) + frozen).sum()

    original = torch.autograd.Function.__dict__["apply"]
    g = trace(Checkpointed(), {"x": torch.randn(2, 4, requires_grad=True)})
    assert torch.autograd.Function.__dict__["apply"] is original  # put back after tracing
    modes = [(n.module_path, n.target.rsplit(".", 1)[-1], n.grad_enabled) for n in g.nodes]
    assert ("a", "linear", True) in modes and ("", "relu", True) in modes
    assert [m for m in modes if m[:2] == ("b", "linear")] == [("b", "linear", False), ("b", "linear", True)]
    scales = [m[2] for m in modes if m[1] == "apply"]
    assert scales == [False, True]  # Scale, kept whole: under the user's no_grad, then not


def test_python_attributes_changed_by_forward_warn_and_are_restored():
    from nnscaler.ir import TracingWarning

    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.inner.calls = 0
            self.name = "counts"

        def forward(self, x):
            self.inner.calls += 1
            return self.inner(x).sum()

    m = Counts()
    with pytest.warns(TracingWarning, match=r"Python attribute\(s\) inner\.calls .*register_buffer") as record:
        trace(m, {"x": torch.randn(2, 4)})
    assert m.inner.calls == 0 and m.name == "counts"
    assert os.path.realpath(record[0].filename) == os.path.realpath(__file__)  # points at the caller


def test_hooks_on_the_model_are_reported():
    from nnscaler.ir import TracingWarning

    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    features = []

    def keep_features(module, args, output):
        features.append(output)

    m[0].register_forward_hook(keep_features)
    m.register_full_backward_hook(lambda module, gin, gout: None)
    with pytest.warns(TracingWarning, match=r"backward hook .* on the model; forward hook .*keep_features on 0") as rec:
        trace(m, {"input": torch.randn(2, 4)})
    assert os.path.realpath(rec[0].filename) == os.path.realpath(__file__)
    assert "side effects" in str(rec[0].message) and len(features) == 2  # ran in both traces, not in the code
    with warnings.catch_warnings():
        warnings.simplefilter("error", TracingWarning)
        trace(nn.Sequential(nn.Linear(4, 4)), {"input": torch.randn(2, 4)})  # no hooks: silent


class WritesWeights(nn.Module):
    """Updates its parameters in place in forward, by every route the tracer sees."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.a.weight.mul_(0.5)
            self.a.weight.data.add_(1.0)
            self.b.weight[0] = 0.0
            torch.mul(self.b.bias, 3.0, out=self.b.bias)
        return self.b(self.a(x)).sum()


def test_parameters_updated_in_place_by_forward_are_restored():
    m = WritesWeights()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    g = trace(m, {"x": torch.randn(2, 4)})  # traced twice (train and eval): 0.25x without the restore
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert sum(n.inplace for n in g.nodes) >= 3  # the updates are in the program, not applied once


def _scale_weight_(w):  # a custom op runs unrecorded inside: its write is invisible to the tracer
    with torch.no_grad():
        w.mul_(2.0)
    return w * 1.0


class Hidden(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.op = op

    def forward(self, x):
        return (x @ self.op(self.fc.weight)).sum()


def test_parameter_changed_where_the_trace_cannot_see_is_refused_by_name():
    from nnscaler.ir.ops.registry import REGISTRY, register_op

    op = register_op(_scale_weight_, "a b -> a b", name="tests.scale_weight_")
    try:
        with pytest.raises(TraceError, match=r"fc\.weight in place by a route the trace cannot follow"):
            trace(Hidden(op), {"x": torch.randn(2, 4)}, both_modes=False)
    finally:
        REGISTRY._ops.pop(_scale_weight_, None)
        REGISTRY._ops.pop(op, None)
        REGISTRY._user.difference_update({_scale_weight_, op})
