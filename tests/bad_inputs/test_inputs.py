"""Example inputs and call inputs that do not fit the generated program."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from nnscaler import ComputeConfig, parallelize


class MeanLoss(nn.Module):
    """loss = sum / batch size: with constant folding the traced batch size is a constant."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x).sum() / x.shape[0]


class DictInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)

    def forward(self, batch):
        return self.emb(batch["ids"]).view(batch["ids"].shape[0], -1).sum()


MeanLoss.__module__ = DictInput.__module__ = __name__


def _pm(model, args, tmp_path, folding):
    return parallelize(model, args, "dp", ComputeConfig(1, 1, constant_folding=folding, trace_strategy="cpu"), gen_savedir=tmp_path)


def test_constant_folding_refuses_another_batch_size(tmp_path):
    torch.manual_seed(0)
    model = MeanLoss()
    pm = _pm(model, {"x": torch.randn(4, 16)}, tmp_path, True)
    x4 = torch.randn(4, 16)
    torch.testing.assert_close(pm(x4), model(x4))
    with pytest.raises(ValueError) as info:
        pm(torch.randn(8, 16))  # before: twice the loss, no error
    msg = str(info.value)
    assert "argument x has shape (8, 16), dtype float32" in msg
    assert "traced with constant_folding=True on shape (4, 16), dtype float32 (or another float dtype)" in msg
    assert "constant_folding=False" in msg  # the fix


def test_constant_folding_refuses_another_dtype(tmp_path):
    pm = _pm(MeanLoss(), {"x": torch.randn(4, 16)}, tmp_path, True)
    with pytest.raises(ValueError, match=r"argument x has shape \(4, 16\), dtype int64.*dtype float32 \(or another "
                                         r"float dtype\)"):
        pm(torch.ones(4, 16, dtype=torch.int64))
    pm_ids = _pm(DictInput(), {"batch": {"ids": torch.zeros(4, 3, dtype=torch.int64)}}, tmp_path / "ids", True)
    with pytest.raises(ValueError, match=r"argument batch\['ids'\] has shape \(4, 3\), dtype int32.*dtype int64:"):
        pm_ids({"ids": torch.zeros(4, 3, dtype=torch.int32)})
    with pytest.raises(ValueError, match=r"argument x has type ndarray"):
        pm(torch.randn(4, 16).numpy())


def test_constant_folding_names_a_nested_argument(tmp_path):
    torch.manual_seed(0)
    model = DictInput()
    pm = _pm(model, {"batch": {"ids": torch.randint(0, 10, (4, 3))}}, tmp_path, True)
    ids = torch.randint(0, 10, (4, 3))
    torch.testing.assert_close(pm({"ids": ids}), model({"ids": ids}))
    with pytest.raises(ValueError, match=r"argument batch\['ids'\] has shape \(2, 3\), dtype int64.*\(4, 3\)"):
        pm({"ids": torch.randint(0, 10, (2, 3))})


def test_without_folding_other_sizes_give_the_right_numbers(tmp_path):
    torch.manual_seed(0)
    model = MeanLoss()
    pm = _pm(model, {"x": torch.randn(4, 16)}, tmp_path, False)
    x8 = torch.randn(8, 16)
    torch.testing.assert_close(pm(x8), model(x8))


def test_without_folding_another_rank_is_refused(tmp_path):
    pm = _pm(MeanLoss(), {"x": torch.randn(4, 16)}, tmp_path, False)
    with pytest.raises(ValueError, match=r"argument x has shape \(2, 4, 16\), dtype float32, but the model was "
                                         r"traced with 2 dim\(s\)"):
        pm(torch.randn(2, 4, 16))


# -- example inputs of the wrong kind -------------------------------------------------------------------
def test_numpy_example_input_names_the_argument(tmp_path):
    with pytest.raises(TypeError) as info:
        _pm(MeanLoss(), {"x": np.zeros((4, 16), dtype="float32")}, tmp_path, False)
    msg = str(info.value)
    assert msg.startswith("example input dummy_forward_args['x'] is a numpy.ndarray of shape (4, 16), not a "
                          "torch.Tensor") and "torch.from_numpy" in msg
    assert "linear()" not in msg


def test_nested_numpy_example_input_names_the_path():
    from nnscaler.ir import trace
    with pytest.raises(TypeError, match=r"dummy_forward_args\['batch'\]\['ids'\] is a numpy.ndarray"):
        trace(DictInput(), {"batch": {"ids": np.zeros((4, 3), dtype="int64")}})


def test_quantized_buffer_is_refused_naming_it():
    from nnscaler.ir import trace
    model = MeanLoss()
    with pytest.warns(UserWarning):  # torch deprecates quantized tensors; what matters is our refusal
        q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    model.register_buffer("scale_q", q)
    with pytest.raises(TypeError, match=r"^buffer 'scale_q' of MeanLoss is quantized \(torch.qint8\).*dequantize"):
        trace(model, {"x": torch.randn(4, 16)})


def test_sparse_parameter_and_input_are_refused_naming_them():
    from nnscaler.ir import trace
    model = MeanLoss()
    model.fc.weight = nn.Parameter(torch.eye(16).to_sparse())
    with pytest.raises(TypeError, match=r"^parameter 'fc.weight' of MeanLoss has layout torch.sparse_coo.*to_dense"):
        trace(model, {"x": torch.randn(4, 16)})
    with pytest.raises(TypeError, match=r"^example input dummy_forward_args\['x'\] has layout torch.sparse_coo"):
        trace(MeanLoss(), {"x": torch.randn(4, 16).to_sparse()})


def test_channels_last_inputs_and_weights_give_the_right_numbers(tmp_path):
    """A memory format is only strides: it traces and gives the same numbers (not refused)."""
    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return self.conv(x).sum()

    Conv.__module__ = __name__
    torch.manual_seed(0)
    model = Conv().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    pm = _pm(model, {"x": x}, tmp_path, False)
    torch.testing.assert_close(pm(x), model(x))
