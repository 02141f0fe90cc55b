"""A pipelined module follows .train() / .eval() (2 gloo processes, pp 2): in eval mode
`infer_step` turns dropout off and matches the single-device model in eval mode on every rank; in
training mode `train_step` drops out again; a forward whose Python control flow depends on self.training is refused in the other mode."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from launch import run_workers

NMICROS = 2


class DropMLP(nn.Module):
    def __init__(self, branchy=False):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)) for _ in range(4))
        self.branchy = branchy

    def forward(self, x, y):
        for block in self.blocks:
            x = F.gelu(block(x))
        if self.branchy and self.training:
            x = x * 2
        return F.mse_loss(x.sum(-1), y)


def _micros(step):
    g = torch.Generator().manual_seed(step)
    return [{"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, generator=g)} for _ in range(NMICROS)]


def _make(branchy=False):
    torch.manual_seed(0)
    return DropMLP(branchy)


def work(rank, world, gen_dir):
    from nnscaler import ComputeConfig, parallelize
    from nnscaler.runtime.errors import NnScalerError

    def pipelined(branchy):
        cfg = ComputeConfig(2, 2, trace_strategy="cpu", use_end2end=True,
                            pas_config={"pipeline_nmicros": NMICROS, "pipeline_pivots": "Sequential"})
        return parallelize(_make(branchy), _micros(0)[0], "pp", cfg, gen_savedir=gen_dir,
                           instance_name=f"modes_{branchy}")

    pm = pipelined(False)
    pm.eval()
    evaluated = [[o.item() for o in pm.infer_step(_micros(1))] for _ in range(2)]
    pm.train()
    trained = [o.item() for o in pm.train_step(_micros(2))]
    branchy = pipelined(True)
    branchy.eval()
    try:
        branchy.infer_step(_micros(1))
        refused = None
    except NnScalerError as exc:
        refused = str(exc)
    return dict(evaluated=evaluated, trained=trained, refused=refused)


@pytest.mark.multiprocess
def test_pipeline_follows_train_and_eval(tmp_path):
    results = run_workers(work, 2, str(tmp_path / "gen"), timeout=200)
    model = _make().eval()
    with torch.no_grad():
        want = [model(**mb).item() for mb in _micros(1)]
    with torch.no_grad():
        no_dropout = [model(**mb).item() for mb in _micros(2)]
    for rank, r in enumerate(results):
        assert all(abs(a - b) <= 1e-6 for got in r["evaluated"] for a, b in zip(got, want)), (rank, r["evaluated"], want)
        assert r["trained"] == results[0]["trained"]  # the outputs are broadcast: every rank the same
        assert all(abs(a - b) > 1e-4 for a, b in zip(r["trained"], no_dropout)), "dropout was off in training mode"
        assert r["refused"] and "eval mode" in r["refused"] and "x = x * 2" in r["refused"], r["refused"]
