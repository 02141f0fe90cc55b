"""Calls of a parallelized module whose arguments do not fit what was traced (issue 26)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from nnscaler import ComputeConfig, parallelize


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        return ((self.fc(x) - y) ** 2).mean()


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, scale, shift=1, mode="sum"):
        out = self.fc(x) * scale + shift
        return out.sum() if mode == "sum" else out.mean()


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)

    def forward(self, ids):
        return self.emb(ids).sum()


MLP.__module__ = Scaled.__module__ = Embed.__module__ = __name__


def _pm(model, args, tmp_path, folding=False):
    return parallelize(model, args, "dp", ComputeConfig(1, 1, constant_folding=folding, trace_strategy="cpu"),
                       gen_savedir=tmp_path)


@pytest.fixture
def mlp(tmp_path):
    return _pm(MLP(), {"x": torch.randn(4, 8), "y": torch.randn(4, 8)}, tmp_path)


@pytest.mark.parametrize("call, reason", [
    (lambda pm, x: pm(x=x), r"missing a required argument: 'y' \(the call passed x=\)"),
    (lambda pm, x: pm(x=x, y=x, z=1), r"got an unexpected keyword argument 'z'"),
    (lambda pm, x: pm(x, x, x), r"too many positional arguments \(the call passed 3 positional\)"),
    (lambda pm, x: pm(x, x=x), r"multiple values for argument 'x'"),
])
def test_wrong_arguments_name_the_models_forward(mlp, call, reason):
    from nnscaler.runtime import ForwardArgumentError, NnScalerError
    with pytest.raises(ForwardArgumentError, match=r"^MLP.forward\(x, y\): " + reason) as info:
        call(mlp, torch.randn(4, 8))  # before: "MLP._forward_impl() got an unexpected keyword argument 'z'"
    assert "_forward_impl" not in str(info.value) and isinstance(info.value, (NnScalerError, TypeError))
    assert "reuse='override'" in str(info.value)


def test_a_type_error_from_inside_forward_is_left_as_it_is(mlp):
    """Only a call whose arguments do not bind is rewritten; another TypeError keeps its message."""
    from nnscaler.runtime.call_arguments import call_error
    x = torch.randn(4, 8)
    assert call_error(mlp, TypeError("inside"), (x, x), {}) is None
    assert call_error(mlp, ValueError("inside"), (x,), {}) is None
    assert "missing a required argument: 'y'" in str(call_error(mlp, TypeError("call"), (x,), {}))


@pytest.mark.parametrize("folding", [False, True])
@pytest.mark.parametrize("given, shown", [(1.5, "float"), ([1.0, 2.0], "list")])
def test_a_float_or_list_for_a_tensor_names_the_argument(mlp, tmp_path, folding, given, shown):
    pm = mlp if not folding else _pm(MLP(), {"x": torch.randn(4, 8), "y": torch.randn(4, 8)}, tmp_path / "f", True)
    with pytest.raises(ValueError, match=rf"^argument x has type {shown}, not a tensor, but the model was traced "
                                         rf"with .*\(4, 8\)"):
        pm(given, torch.randn(4, 8))


def test_float_for_integer_ids_is_refused_without_folding(tmp_path):
    pm = _pm(Embed(), {"ids": torch.randint(0, 10, (4, 3))}, tmp_path)
    pm(torch.randint(0, 10, (2, 5)))  # other sizes are fine without constant folding
    with pytest.raises(ValueError, match=r"^argument ids has shape \(4, 3\), dtype float32, but the model was "
                                         r"traced with 2 dim\(s\) \(shape \(4, 3\)\) of an integer/bool dtype "
                                         r"\(int64\)"):
        pm(torch.rand(4, 3))  # before: an error from inside embedding()
    pm_f = _pm(MLP(), {"x": torch.randn(4, 8), "y": torch.randn(4, 8)}, tmp_path / "f")
    pm_f(torch.randn(4, 8, dtype=torch.float64).float(), torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"argument x has shape \(4, 8\), dtype int64.*floating-point dtype"):
        pm_f(torch.ones(4, 8, dtype=torch.int64), torch.randn(4, 8))


def test_another_python_scalar_is_refused(tmp_path):
    """A scalar argument is a constant of the program: before, scale=3.0 silently computed with 2.0."""
    torch.manual_seed(0)
    model = Scaled()
    pm = _pm(model, {"x": torch.randn(4, 8), "scale": 2.0}, tmp_path)
    x = torch.randn(4, 8)
    torch.testing.assert_close(pm(x, 2.0), model(x, 2.0))
    torch.testing.assert_close(pm(x, 2), model(x, 2))  # the same number as an int
    with pytest.raises(ValueError) as info:
        pm(x, 3.0)
    msg = str(info.value)
    assert msg.startswith("argument scale is 3.0, but the model was traced with scale=2.0")
    assert "torch.tensor(...)" in msg
    with pytest.raises(ValueError, match=r"^argument shift is 5, but the model was traced without it in "
                                         r"dummy_forward_args, so with its default shift=1"):
        pm(x, 2.0, shift=5)
    with pytest.raises(ValueError, match=r"^argument mode is 'mean'.*mode='sum'"):
        pm(x, 2.0, mode="mean")
    with pytest.raises(ValueError, match=r"^argument scale is tensor\(2.\), but the model was traced with scale=2.0"):
        pm(x, torch.tensor(2.0))
