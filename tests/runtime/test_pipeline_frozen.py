"""Fine-tuning through a pipeline whose first stage is entirely frozen (2 gloo processes, pp 2):
the rank holding no trainable parameter still builds its optimizer and takes part in gradient
clipping; losses, the clipped norm and every parameter after 3 Adam steps match one process
within 1e-5, and the frozen stage's weights stay exactly as they were."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from launch import run_workers

STEPS, NMICROS, LR, CLIP, TOL = 3, 2, 1e-2, 0.1, 1e-5


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8)) for _ in range(4))

    def forward(self, x, y):
        for block in self.blocks:
            x = F.gelu(block(x))
        return F.mse_loss(x.sum(-1), y)


def _make():
    torch.manual_seed(0)
    model = Blocks()
    for block in model.blocks[:2]:  # the whole first stage
        block.requires_grad_(False)
    return model


def _micros(step):
    g = torch.Generator().manual_seed(step)
    return [{"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, generator=g)} for _ in range(NMICROS)]


def work(rank, world, gen_dir):
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    cfg = ComputeConfig(2, 2, trace_strategy="cpu", use_end2end=True,
                        pas_config={"pipeline_nmicros": NMICROS, "pipeline_pivots": "Sequential"})
    pm = parallelize(_make(), _micros(0)[0], "pp", cfg, gen_savedir=gen_dir)
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    trainable = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        losses.append([o.item() for o in pm.train_step(_micros(step))])
        opt.scale_grads(1 / NMICROS)
        norms.append(opt.clip_gnorm(CLIP).item())
        opt.step()
    params = {e.full_name: getattr(pm, local).detach().clone() for local, e in pm.fullmap.items()
              if isinstance(getattr(pm, local), nn.Parameter)}
    return dict(trainable=trainable, losses=losses, norms=norms, params=params)


def reference():
    model = _make()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        step_losses = []
        for mb in _micros(step):
            loss = model(**mb)
            loss.backward()
            step_losses.append(loss.item())
        trainable = [p for p in model.parameters() if p.requires_grad]
        for p in trainable:
            p.grad.mul_(1 / NMICROS)
        norms.append(torch.nn.utils.clip_grad_norm_(trainable, CLIP).item())
        opt.step()
        losses.append(step_losses)
    return losses, norms, {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.multiprocess
def test_frozen_stage_trains_like_one_process(tmp_path):
    results = run_workers(work, 2, str(tmp_path / "gen"), timeout=200)
    ref_losses, ref_norms, ref_params = reference()
    initial = dict(_make().named_parameters())
    assert results[0]["trainable"] == 0 and results[1]["trainable"] > 0  # rank 0: the frozen stage
    held = {}
    for rank, r in enumerate(results):
        for got, want in zip(r["losses"], ref_losses):
            assert all(abs(a - b) <= TOL for a, b in zip(got, want)), (rank, got, want)
        assert all(abs(a - b) <= TOL * max(1, b) for a, b in zip(r["norms"], ref_norms)), (rank, r["norms"], ref_norms)
        held.update(r["params"])
    assert set(held) == set(ref_params)
    for name, value in held.items():
        assert (value - ref_params[name]).abs().max().item() <= TOL, name
        if name.startswith(("blocks.0.", "blocks.1.")):
            assert torch.equal(value, initial[name].detach()), f"frozen {name} changed"
