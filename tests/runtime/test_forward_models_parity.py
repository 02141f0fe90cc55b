"""Forwards a trace could get silently wrong train like one process under tp and dp:

- a user's torch.autograd.Function keeps its backward (a straight-through estimator; the inlined
  trace gave the layer before it a zero gradient);
- parameters updated in place under no_grad in forward (a max-norm constraint, a decay) are
  updated by the generated program on every step, and tracing leaves them untouched (it used to
  apply the update while tracing, so the ranks started from different weights)."""
from __future__ import annotations

import sys

import pytest
import torch

from forward_models import MODELS, quant_batch
from launch import run_workers
from parity import assemble_full, train_steps

STEPS = 4
GLOBAL_BATCH = 8
LR = 1e-2
TOL = 1e-5


def reference(name):
    model = MODELS[name]()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, first_grad = [], None
    for step in range(STEPS):
        loss = model(**quant_batch(step, GLOBAL_BATCH))
        opt.zero_grad()
        loss.backward()
        if first_grad is None:
            first_grad = model.fc1.weight.grad.norm().item()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}, first_grad


def train(rank, world, name, policy, plan, gen_dir, zero=False):
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    dp = world // plan
    cfg = ComputeConfig(plan, world, trace_strategy="cpu", use_zero=zero)
    model = MODELS[name]()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    pm = parallelize(model, quant_batch(0, GLOBAL_BATCH // dp), policy, cfg,
                     gen_savedir=gen_dir, instance_name=f"{name}_{policy}_{plan}_{world}_{zero}")
    untouched = all(torch.equal(v, initial[k]) for k, v in model.state_dict().items())
    code = open(sys.modules[type(pm).__module__].__file__).read()
    targets = {name for name in ("RoundSTE.apply(", "ScaleGrad.apply(") if f"forward_models.{name}" in code}
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    losses = train_steps(pm, opt, quant_batch, steps=STEPS, global_batch=GLOBAL_BATCH,
                         dp_rank=rank // plan, dp=dp)
    shards = [(e.full_name, e.full_shape, e.slices, getattr(pm, local).detach().clone())
              for local, e in pm.fullmap.items() if isinstance(getattr(pm, local), torch.nn.Parameter)]
    return losses, shards, sorted(targets), untouched


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["quant", "max_norm"])
@pytest.mark.parametrize("policy, plan, zero", [("tp", 2, False), ("dp", 1, False), ("dp", 1, True)])
def test_forward_trains_like_one_process(name, policy, plan, zero, tmp_path):
    results = run_workers(train, 2, name, policy, plan, str(tmp_path / "gen"), zero, timeout=300)
    ref_losses, ref_params, first_grad = reference(name)
    assert first_grad > 0.1  # fc1 gets a real gradient (through the STE, round's own would be 0)
    if name == "quant":
        assert results[0][2] == ["RoundSTE.apply(", "ScaleGrad.apply("]  # called whole by the generated code
    assert all(r[3] for r in results)  # parallelize() left the user's model as it was
    for step, (got, want) in enumerate(zip(results[0][0], ref_losses)):
        assert abs(got - want) <= TOL * abs(want), f"{name} {policy} step {step}: {got} vs {want}"
    params = assemble_full(((r, res[1]) for r, res in enumerate(results)), policy)
    assert set(params) == set(ref_params)
    for pname, value in params.items():
        rel = ((value - ref_params[pname]).norm() / ref_params[pname].norm()).item()
        assert rel <= TOL, f"{name} {policy}: {pname} differs by {rel:.2e} (relative)"
