"""offload_optimizer: build_optimizer's optimizer steps on fp32 copies on another device (here the
CPU, which is also the module's device: the same code path copies GPU -> pinned host memory on
CUDA) and trains exactly as the plain optimizer; misuse is refused with the fix."""
from __future__ import annotations

import pytest
import torch

from launch import run_workers
from nnscaler.runtime import ConfigError, offload_optimizer


def test_refuses_an_optimizer_not_built_by_build_optimizer():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ConfigError, match=r"offload_optimizer needs the optimizer built by "
                                          r"nnscaler.runtime.build_optimizer, got SGD"):
        offload_optimizer(opt, "cpu")


def offload_worker(rank, world):
    import tempfile
    from nnscaler.ir import ComputeConfig
    from nnscaler.runtime import OffloadedOptimizer, build_optimizer, parallelize, step_gradients
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    ref.load_state_dict(net.state_dict())
    with tempfile.TemporaryDirectory() as gen:
        pm = parallelize(net, {"input": torch.randn(5, 4)}, "dp", ComputeConfig(1, 1), gen_savedir=gen,
                         instance_name="offload-runtime")
    stepped = build_optimizer(pm, torch.optim.Adam, lr=0.1)
    pm(torch.randn(5, 4)).sum().backward()
    stepped.step()
    out = {}
    try:
        offload_optimizer(stepped, "cpu")
    except ConfigError as e:
        out["has_state"] = str(e)
    stepped.zero_grad()
    opt = offload_optimizer(build_optimizer(pm, torch.optim.Adam, lr=0.1), "cpu")
    out["same_again"] = offload_optimizer(opt, "cpu") is opt
    try:
        offload_optimizer(opt, "meta")
    except ConfigError as e:
        out["other_device"] = str(e)
    params = list(pm.parameters())
    with torch.no_grad():  # the reference starts from the module's values (the step above moved them)
        for p, q in zip(params, ref.parameters()):
            q.copy_(p)
    opt.refresh_offload()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    copies = opt.param_groups[0]["params"]
    out["offloaded"] = isinstance(opt, OffloadedOptimizer) and isinstance(opt, torch.optim.Adam)
    out["distinct"] = all(c is not p and c.data_ptr() != p.data_ptr() and c.dtype == torch.float32
                          for c, p in zip(copies, params)) and len(copies) == 4
    out["step_gradients"] = step_gradients(opt) == params
    x = torch.randn(5, 4)
    diffs, norms = [], []

    def step():
        for m, o in ((pm, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().sum().backward()
        norm = opt.clip_gnorm(0.5)  # on the module's gradients, before the copy
        norms.append((norm - torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)).abs().item())
        out.setdefault("copy_grads_before_step", all(c.grad is None for c in copies))
        opt.step()
        ref_opt.step()
        out.setdefault("copy_grads_after_step", all(c.grad is None for c in copies))
        diffs.append(max((p.detach() - q.detach()).abs().max().item() for p, q in zip(params, ref.parameters())))

    for _ in range(3):
        step()
    out["diffs"] = diffs
    states = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    out["states"] = len(states)
    out["states_apart"] = not {v.data_ptr() for v in states} & {p.data_ptr() for p in params}
    opt.zero_grad()
    out["module_grads_cleared"] = all(p.grad is None for p in params)
    with torch.no_grad():  # set outside the optimizer (in both): the copy follows at the next step
        params[0].fill_(0.25)
        next(ref.parameters()).fill_(0.25)
    step()
    out["diff_after_outside_change"] = diffs[-1]
    out["norm_diffs"] = norms
    return out


@pytest.mark.multiprocess
def test_offloaded_optimizer_trains_as_the_plain_one():
    out = run_workers(offload_worker, 1, timeout=120)[0]
    assert "already has state; offload it before it steps" in out["has_state"]
    assert out["same_again"] and "offloaded to cpu already, not meta" in out["other_device"]
    assert out["offloaded"] and out["distinct"] and out["step_gradients"]
    assert max(out["diffs"]) <= 1e-6, out["diffs"]
    assert max(out["norm_diffs"]) <= 1e-6, out["norm_diffs"]  # clip_gnorm acts on the module's gradients
    assert out["copy_grads_before_step"] and out["copy_grads_after_step"]  # they reach the copies inside step only
    assert out["module_grads_cleared"]
    assert out["diff_after_outside_change"] <= 1e-6  # a parameter set outside the optimizer refreshes its copy
    assert out["states"] == 8 and out["states_apart"]  # Adam's two moments per tensor, on the copies
