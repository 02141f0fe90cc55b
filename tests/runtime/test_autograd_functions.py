"""A user's torch.autograd.Function keeps its backward under every plan: a straight-through
estimator trains like one process (the inlined trace gave the layer before it a zero gradient)."""
from __future__ import annotations

import sys

import pytest
import torch

from function_models import make_quant_mlp, quant_batch
from launch import run_workers
from parity import assemble_full, train_steps

STEPS = 4
GLOBAL_BATCH = 8
LR = 1e-2
TOL = 1e-5


def reference():
    model = make_quant_mlp()
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


def train(rank, world, policy, plan, gen_dir):
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    dp = world // plan
    cfg = ComputeConfig(plan, world, trace_strategy="cpu")
    pm = parallelize(make_quant_mlp(), quant_batch(0, GLOBAL_BATCH // dp), policy, cfg,
                     gen_savedir=gen_dir, instance_name=f"ste_{policy}_{plan}_{world}")
    code = open(sys.modules[type(pm).__module__].__file__).read()
    targets = {name for name in ("RoundSTE.apply(", "ScaleGrad.apply(") if f"function_models.{name}" in code}
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    losses = train_steps(pm, opt, quant_batch, steps=STEPS, global_batch=GLOBAL_BATCH,
                         dp_rank=rank // plan, dp=dp)
    shards = [(e.full_name, e.full_shape, e.slices, getattr(pm, local).detach().clone())
              for local, e in pm.fullmap.items() if isinstance(getattr(pm, local), torch.nn.Parameter)]
    return losses, shards, sorted(targets)


@pytest.mark.multiprocess
@pytest.mark.parametrize("policy, plan", [("tp", 2), ("dp", 1)])
def test_straight_through_estimator_trains_like_one_process(policy, plan, tmp_path):
    results = run_workers(train, 2, policy, plan, str(tmp_path / "gen"), timeout=300)
    ref_losses, ref_params, first_grad = reference()
    assert first_grad > 0.1  # the STE passes a real gradient to fc1 (round's own would be 0)
    assert len(results[0][2]) == 2  # both Functions are called whole by the generated code
    for step, (got, want) in enumerate(zip(results[0][0], ref_losses)):
        assert abs(got - want) <= TOL * abs(want), f"{policy} step {step}: {got} vs {want}"
    params = assemble_full(((r, res[1]) for r, res in enumerate(results)), policy)
    assert set(params) == set(ref_params)
    for name, value in params.items():
        rel = ((value - ref_params[name]).norm() / ref_params[name].norm()).item()
        assert rel <= TOL, f"{policy}: {name} differs by {rel:.2e} (relative)"
