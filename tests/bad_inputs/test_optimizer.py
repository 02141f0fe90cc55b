"""build_optimizer on a module it cannot train (issue 26)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from nnscaler import ComputeConfig, build_optimizer, parallelize
from nnscaler.runtime import NnScalerError

from .models import Small


class NoParams(nn.Module):
    def forward(self, x):
        return (x * 2).sum()


NoParams.__module__ = __name__


def _pm(model, tmp_path):
    return parallelize(model, {"x": torch.randn(2, 4)}, "dp", ComputeConfig(1, 1, trace_strategy="cpu"),
                       gen_savedir=tmp_path)


def test_frozen_model_is_refused_naming_the_fix(tmp_path):
    model = Small().requires_grad_(False)
    pm = _pm(model, tmp_path)
    with pytest.raises(NnScalerError) as info:  # before: an Adam over an empty group, updating nothing
        build_optimizer(pm, torch.optim.Adam, lr=1e-3)
    msg = str(info.value)
    assert msg.startswith("build_optimizer: Small has no trainable parameters (all its 2 parameter tensor(s) have "
                          "requires_grad=False)")
    assert "requires_grad=True" in msg and "before parallelize()" in msg


def test_model_without_parameters_is_refused(tmp_path):
    pm = _pm(NoParams(), tmp_path)
    with pytest.raises(NnScalerError, match=r"^build_optimizer: NoParams has no trainable parameters \(it has no "
                                            r"parameters\)"):
        build_optimizer(pm, torch.optim.SGD, lr=0.1)


def test_partly_frozen_model_builds(tmp_path):
    model = Small()
    model.fc.bias.requires_grad_(False)
    opt = build_optimizer(_pm(model, tmp_path), torch.optim.SGD, lr=0.1)
    assert [p.shape for g in opt.param_groups for p in g["params"]] == [torch.Size([4, 4])]
