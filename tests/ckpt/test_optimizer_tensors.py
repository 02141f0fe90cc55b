"""Optimizer state by parameter name: the user's class behind nnscaler's wrappers, hyper-parameters
typed as the optimizer has them, fp32 master weights kept as a state."""
import json

import pytest
import torch

from fake_modules import FakeParallel
from nnscaler.ckpt import load, save
from nnscaler.ckpt.optimizer_tensors import apply_hyper_parameters, hyper_parameters, optimizer_class, zero_layout
from nnscaler.ir.contracts import OptimizerAttrs


def _bf16(seed):
    from nnscaler.runtime.precision import with_master_weights
    pm = FakeParallel(seed=seed)
    for p in pm.parameters():
        p.data = p.data.to(torch.bfloat16)
    return pm, with_master_weights(torch.optim.Adam(pm.parameters(), lr=0.1))


def test_class_behind_wrappers():
    _, opt = _bf16(0)
    assert type(opt).__name__ != "Adam" and optimizer_class(opt) == "torch.optim.adam.Adam"


def test_hyper_parameters_keep_their_types():
    opt = torch.optim.Adam(FakeParallel().parameters(), lr=torch.tensor(0.01), betas=(0.8, 0.9))
    saved = json.loads(json.dumps(hyper_parameters(opt)))
    assert saved[0]["betas"] == [0.8, 0.9] and abs(saved[0]["lr"] - 0.01) < 1e-9
    groups = apply_hyper_parameters(opt.state_dict()["param_groups"], saved)
    assert groups[0]["betas"] == (0.8, 0.9) and isinstance(groups[0]["lr"], torch.Tensor)
    assert groups[0]["params"] == [0, 1, 2]


def test_master_weights_round_trip(tmp_path):
    pm, opt = _bf16(0)
    for step in range(2):
        opt.zero_grad()
        pm(torch.randint(0, 6, (5,), generator=torch.Generator().manual_seed(step))).float().backward()
        opt.step()
    save(tmp_path / "ck", pm, opt)
    states = {r["state"] for r in json.loads((tmp_path / "ck" / "manifest.json").read_text())["optimizer_state"]}
    assert states == {"exp_avg", "exp_avg_sq", "master_weights", "step"}
    pm2, opt2 = _bf16(5)
    load(tmp_path / "ck", pm2, opt2)
    a, b = opt.state_dict()["master_weights"], opt2.state_dict()["master_weights"]
    assert a.keys() == b.keys() and all(torch.equal(a[i], b[i]) and a[i].dtype == torch.float32 for i in a)
    assert all(torch.equal(x, y) for x, y in zip(pm.state_dict().values(), pm2.state_dict().values()))


def test_the_zero_layout_is_read_through_the_ir_contract():
    """Only an `OptimizerAttrs` (what build_optimizer returns) has a ZeRO layout; an attribute of
    that name on another optimizer is not read."""
    pm = FakeParallel()
    plain = torch.optim.Adam(pm.parameters(), lr=0.1)
    plain.zero_layout = "not a layout"
    assert zero_layout(plain) is None

    class Built(OptimizerAttrs, torch.optim.Adam):
        pass
    assert zero_layout(Built(pm.parameters(), lr=0.1)) is None


def _one_step(pm, opt):
    opt.zero_grad()
    pm(torch.randint(0, 6, (5,), generator=torch.Generator().manual_seed(0))).float().backward()
    opt.step()


def _specs(pm, opt, first_step=False):
    from nnscaler.ckpt.buffer_layout import spec_of
    from nnscaler.ckpt.rank_state import collect
    return [spec_of(k, t) for k, t in collect(pm, opt, None, 0, first_step=first_step).tensors]


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=0.1),
    lambda ps: torch.optim.AdamW(ps, lr=0.1, amsgrad=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.SGD(ps, lr=0.1),  # no state tensor at all
    lambda ps: torch.optim.Adagrad(ps, lr=0.1),  # its state exists from the start
    "bf16",
], ids=["adam", "adamw-amsgrad", "sgd-momentum", "sgd", "adagrad", "bf16-master-adam"])
def test_the_first_step_state_is_what_the_first_step_gives(make):
    """What prepare_async_save sizes for before the optimizer's first step (its state estimated
    from one step of its class over a stand-in) is exactly what a save after that step holds:
    the same keys, dtypes and shapes, in the same order."""
    if make == "bf16":
        pm, opt = _bf16(0)
    else:
        pm = FakeParallel(dim=8)
        opt = make(pm.parameters())
    before = _specs(pm, opt, first_step=True)
    _one_step(pm, opt)
    assert before == _specs(pm, opt) == _specs(pm, opt, first_step=True)
    assert all(s[0].startswith(("model/", "optim/", "rng/")) for s in before)


def test_an_optimizer_its_class_cannot_rebuild_gets_no_estimate():
    """An optimizer whose class needs more than its ``defaults`` to be built: nothing is added (the
    first async_save sizes the buffer for what it finds), and nothing is raised."""
    class Needs(torch.optim.SGD):
        def __init__(self, params, scale, **kw):
            super().__init__(params, **kw)

    pm = FakeParallel(dim=8)
    opt = Needs(pm.parameters(), 2.0, lr=0.1, momentum=0.9)
    assert _specs(pm, opt, first_step=True) == _specs(pm, opt)
