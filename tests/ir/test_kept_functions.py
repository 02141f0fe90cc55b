"""A user's torch.autograd.Function is recorded as one node that the generated code calls (its
own backward runs); torch's and nnscaler's Functions are traced through; annotations by
register_op(FunctionClass, ...) are checked like a custom op's."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from nnscaler.ir import TraceError, trace
from nnscaler.ir.ops.custom_op_check import clear_cache
from nnscaler.ir.ops.registry import REGISTRY, register_op


class Ste(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class Outer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return Ste.apply(x) + 1

    @staticmethod
    def backward(ctx, grad):
        return grad


class RowCumsum(torch.autograd.Function):
    """Mixes the values of each row: splitting dim 1 changes the numbers."""

    @staticmethod
    def forward(ctx, x):
        return torch.cumsum(x, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad.flip(1).cumsum(1).flip(1)


class Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


round_ste = Ste.apply  # bound before any trace, as modules often do


class Calls(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.fc(x)).sum()


def _targets(fn, x=None):
    clear_cache()
    graph = trace(Calls(fn), {"x": torch.randn(4, 6) if x is None else x})
    return graph, [n.target for n in graph.nodes]


def test_user_function_is_one_node_called_by_name():
    graph, targets = _targets(Ste.apply)
    assert "test_kept_functions.Ste.apply" in targets
    assert "torch.round" not in targets  # its forward is not inlined (that would lose the backward)
    node = next(n for n in graph.nodes if n.target.endswith("Ste.apply"))
    assert node.annotation is None  # unannotated: runs replicated


def test_apply_bound_before_the_trace_is_kept_too():
    _, targets = _targets(round_ste)
    assert "test_kept_functions.Ste.apply" in targets and "torch.round" not in targets


def test_call_under_no_grad_is_recorded_without_grad():
    def frozen(h):
        with torch.no_grad():
            g = Doubled.apply(h)
        return g + Ste.apply(h)
    graph, _ = _targets(frozen)
    modes = {n.target.rsplit(".", 2)[-2]: n.grad_enabled for n in graph.nodes if n.target.endswith(".apply")}
    assert modes == {"Doubled": False, "Ste": True}


def test_a_function_called_inside_a_kept_function_is_not_recorded():
    _, targets = _targets(Outer.apply)
    assert "test_kept_functions.Outer.apply" in targets
    assert not any(t.endswith("Ste.apply") or t == "torch.round" for t in targets)


def test_torch_checkpoint_function_is_traced_through():
    _, targets = _targets(lambda h: checkpoint(torch.tanh, h, use_reentrant=True))
    assert "torch.tanh" in targets and not any("CheckpointFunction" in t for t in targets)


def test_function_defined_in_a_function_is_refused_naming_it():
    class Local(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 3

        @staticmethod
        def backward(ctx, grad):
            return grad * 3

    with pytest.raises(TraceError) as info:
        _targets(Local.apply)
    msg = str(info.value)
    assert "Local" in msg and "test_kept_functions.py" in msg and "top level of an importable module" in msg


def test_function_of_the_main_script_is_refused():
    class Script(Doubled):
        pass
    Script.__module__, Script.__qualname__ = "__main__", "Script"
    with pytest.raises(TraceError, match=r"Script .*script run as __main__"):
        _targets(Script.apply)


def test_annotated_function_keeps_its_annotation():
    try:
        assert register_op(Doubled, "a b -> a b") is Doubled  # the class stays what the user calls
        graph, _ = _targets(Doubled.apply)
        node = next(n for n in graph.nodes if n.target.endswith("Doubled.apply"))
        assert node.annotation == "a b -> a b"
    finally:
        REGISTRY._ops.pop(Doubled, None)
        REGISTRY._user.discard(Doubled)


def test_wrong_annotation_of_a_function_is_refused():
    try:
        register_op(RowCumsum.apply, "a b -> a b")  # by its apply, as the plan report suggests
        with pytest.raises(TraceError, match=r"RowCumsum.*dim 'b'"):
            _targets(RowCumsum.apply)
        with pytest.raises(ValueError, match="override=True"):
            register_op(RowCumsum, "a b^ -> a b^")
        register_op(RowCumsum, "a b^ -> a b^", override=True)
        graph, _ = _targets(RowCumsum.apply)
        assert next(n for n in graph.nodes if n.target.endswith("RowCumsum.apply")).annotation == "a b^ -> a b^"
    finally:
        REGISTRY._ops.pop(RowCumsum, None)
        REGISTRY._user.discard(RowCumsum)


def test_argument_the_generated_code_cannot_rebuild_is_refused():
    class Opaque:
        pass

    class TakesObject(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, obj):
            return x + 1

        @staticmethod
        def backward(ctx, grad):
            return grad, None
    TakesObject.__qualname__ = "TakesObject"  # importable name check passes; the argument does not
    with pytest.raises(TraceError, match="TakesObject.apply is called with an argument"):
        _targets(lambda h: TakesObject.apply(h, Opaque()))


def test_generated_code_runs_the_functions_backward(tmp_path):
    """One process: the generated module's gradient of fc is the STE's (round's would be zero)."""
    from nnscaler import ComputeConfig, parallelize
    torch.manual_seed(0)
    model = Calls(Ste.apply)
    x = torch.randn(4, 6)
    pm = parallelize(model, {"x": x}, "dp", ComputeConfig(1, 1, trace_strategy="cpu"), gen_savedir=str(tmp_path), load_module=True)
    pm(x=x).backward()
    model(x).backward()
    assert model.fc.weight.grad.abs().sum() > 0
    torch.testing.assert_close(pm.fc.weight.grad if hasattr(pm, "fc") else
                               next(p for p in pm.parameters() if p.shape == (6, 6)).grad, model.fc.weight.grad)
