"""Ops that return their input itself (``x.float()`` on float32, ``x.contiguous()``, ``x.to(x.device)``
...): the result is a new graph value and ``x`` keeps its own (nnscaler.ir.tracer.identity_results).
Before, the result's value was bound to ``x``'s object, so ``h.type_as(x)`` became a cast to the
traced dtype, and a model traced in fp32 and run in bf16 (the Trainer's ``precision: bf16``)
fed float32 activations to its Linear."""
import glob
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler.ir import trace
from nnscaler.ir.graph import Ref


class RMSNormLinear(nn.Module):
    """The Llama way: compute the norm in float32, cast back with ``type_as(x)``, then a Linear."""

    def __init__(self, d=16, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.fc(self.weight * h.type_as(x))


class _LinearInputDtypes(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_rmsnorm_traced_in_fp32_runs_in_bf16_like_the_eager_bf16_model(tmp_path):
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.runtime import PrecisionPlugin

    torch.manual_seed(0)
    model = RMSNormLinear()
    x = torch.randn(2, 5, 16)
    pm = parallelize(model, {"x": x}, "dp", ComputeConfig(1, 1, trace_strategy="cpu"), gen_savedir=tmp_path)
    pm = PrecisionPlugin("bf16").setup_module(pm)  # what the Trainer does with precision: bf16

    eager = RMSNormLinear()
    eager.load_state_dict(model.state_dict())
    eager = eager.to(torch.bfloat16)
    with _LinearInputDtypes() as seen:
        got = pm(x)  # the precision hook casts the input to bf16
    assert seen.dtypes == [torch.bfloat16]
    want = eager(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)  # bf16 tolerances

    code = open(glob.glob(str(tmp_path / "**" / "gencode0.py"), recursive=True)[0]).read()
    calls = [ln for ln in code.splitlines() if re.match(r"\s+\w+ = ", ln)]  # not the source comments
    casts = [c for ln in calls for c in re.findall(r"\.type_as\((\w+)\)", ln)]
    assert casts == ["x"]  # x's later use is x, not the float() result (was: type_as(float_4))


def _input_ref(g):
    return g.inputs[0].leaves[0][1]


def _producer(g, ref):
    return g.producers().get(ref.id)


@pytest.mark.parametrize("op, dtype", [
    (lambda x: x.float(), torch.float32),
    (lambda x: x.to(torch.float32), torch.float32),
    (lambda x: x.to(x.dtype), torch.float32),
    (lambda x: x.type(torch.float32), torch.float32),
    (lambda x: x.type_as(x), torch.float32),
    (lambda x: x.contiguous(), torch.float32),
    (lambda x: x.to(x.device), torch.float32),
    (lambda x: x.cpu(), torch.float32),
    (lambda x: x.double(), torch.float64),
    (lambda x: F.dropout(x, 0.5, training=False), torch.float32),
    (lambda x: x.real, torch.float32),
], ids=["float", "to_dtype", "to_own_dtype", "type", "type_as", "contiguous", "to_device", "cpu",
        "double", "dropout_eval", "real"])
def test_a_result_that_is_the_input_itself_is_a_new_value_and_x_keeps_its_own(op, dtype):
    x = torch.randn(3, 4, dtype=dtype)
    assert op(x) is x  # torch returns the very same object: what this test is about

    class M(nn.Module):
        def forward(self, x):
            y = op(x)
            return y * 2, x * 3

    g = trace(M(), {"x": x}, both_modes=False)
    first, second = (_producer(g, r) for r in g.output)
    assert second.args[0] == _input_ref(g)  # x's later use reads the input, not op's result
    op_node = _producer(g, first.args[0])
    assert op_node is not None and first.args[0] != _input_ref(g)
    assert op_node.args[0] == _input_ref(g)


def test_a_parameter_cast_to_its_own_dtype_keeps_its_value():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return x * self.w.float() + self.w

    m = M()
    before = m.w.detach().clone()
    g = trace(m, {"x": torch.randn(2, 4)}, both_modes=False)
    add = _producer(g, g.output)
    assert add.args[1] == g.params["w"].value  # not the float() result
    assert torch.equal(m.w, before)


def test_in_place_ops_still_rebind_the_variable_even_after_a_no_op_cast():
    class M(nn.Module):
        def forward(self, x):
            y = x.float()
            y.mul_(2)  # eagerly this writes x too (same object)
            return y

    g = trace(M(), {"x": torch.randn(3)}, both_modes=False)
    mul = _producer(g, g.output)
    assert mul.target.endswith("mul_") and mul.inplace
    assert _producer(g, mul.args[0]).target.endswith("float")


def test_eval_mode_dropout_returning_its_input_aligns_with_training_mode():
    class M(nn.Module):
        def forward(self, x):
            return F.dropout(x, 0.5, self.training) + x  # eval: dropout returns x itself

    for training in (True, False):
        g = trace(M().train(training), {"x": torch.randn(4, 4)})
        assert g.mode_divergence is None, g.mode_divergence
        add = _producer(g, g.output)
        assert add.args[1] == _input_ref(g)


def _passthrough(x):
    return x


def test_a_custom_op_returning_its_input_unchanged_is_a_new_value():
    from nnscaler.ir.ops.registry import REGISTRY, register_op

    op = register_op(_passthrough, "a b -> a b", name="tests.passthrough")
    try:
        class M(nn.Module):
            def forward(self, x):
                return op(x) * 2, x * 3

        g = trace(M(), {"x": torch.randn(2, 4)}, both_modes=False)
    finally:
        REGISTRY._ops.pop(_passthrough, None)
        REGISTRY._ops.pop(op, None)
        REGISTRY._user.difference_update({_passthrough, op})
    first, second = (_producer(g, r) for r in g.output)
    assert second.args[0] == _input_ref(g)
    assert first.args[0] != _input_ref(g) and _producer(g, first.args[0]).target.endswith("_passthrough")
