"""A parallelized module follows .train() / .eval() like the single-device model (single process):
dropout and batch norm switch, training-only buffer updates run only in training, mode-dependent
constants follow the mode; a Python branch on self.training that changes the ops is refused in
the other mode with the user's line; a model traced in eval mode starts in eval mode."""
from __future__ import annotations

import copy

import pytest
import torch

from nnscaler import ComputeConfig, parallelize
from nnscaler.runtime.errors import NnScalerError

from mode_models import Branchy, DropNorm


def _x(seed):
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))


def _parallelize(model, tmp_path, name):
    cfg = ComputeConfig(1, 1, trace_strategy="cpu")
    return parallelize(model, {"x": _x(0)}, "dp", cfg, gen_savedir=tmp_path, instance_name=name)


def _buffers(module):
    return {k.replace(".", "_"): v.clone() for k, v in module.named_buffers()}


def _assert_same_state(pm, ref):
    for name, value in _buffers(ref).items():
        assert torch.equal(getattr(pm, name), value), name


@pytest.mark.parametrize("traced_in", ["train", "eval"])
def test_train_and_eval_match_the_single_device_model(tmp_path, traced_in):
    torch.manual_seed(0)
    model = DropNorm()
    getattr(model, traced_in)()
    ref = copy.deepcopy(model)
    pm = _parallelize(model, tmp_path, traced_in)
    assert pm.training == (traced_in == "train")  # starts in the traced mode
    for step, mode in enumerate(["train", "eval", "train", "eval", "eval", "train"]):
        getattr(pm, mode)()
        getattr(ref, mode)()
        x = _x(step + 1)
        torch.manual_seed(step)
        want = ref(x)
        pm.manual_seed(step)  # the module's random stream (runtime/random.py) = torch.manual_seed
        got = pm(x)
        assert torch.equal(got, want), (mode, step, got, want)
        if mode == "train":
            want.backward()
            got.backward()
            assert torch.equal(pm.fc_weight.grad, ref.fc.weight.grad)
            pm.zero_grad()
            ref.zero_grad()
        _assert_same_state(pm, ref)
    assert int(pm.bn_num_batches_tracked) == 3 and int(pm.calls) == 6


def test_eval_outputs_are_deterministic(tmp_path):
    pm = _parallelize(DropNorm(), tmp_path, "det")
    pm.eval()
    x = _x(1)
    assert torch.equal(pm(x), pm(x))
    pm.train()
    assert not torch.equal(pm(x), pm(x))  # dropout is on again


def test_python_branch_on_training_is_refused_in_the_other_mode(tmp_path):
    torch.manual_seed(0)
    model = Branchy()
    ref = copy.deepcopy(model)
    pm = _parallelize(model, tmp_path, "branchy")
    assert "h = torch.tanh(h)" in pm.MODE_DIVERGENCE
    pm.eval()
    with pytest.raises(NnScalerError) as err:
        pm(_x(1))
    message = str(err.value)
    assert "eval mode" in message and "mode_models.py" in message and "h = torch.tanh(h)" in message
    assert ".train()" in message and "training=self.training" in message
    pm.train()
    assert torch.equal(pm(_x(1)), ref(_x(1)))
