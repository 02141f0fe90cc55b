"""No gradient synchronisation for tensors that need no gradient (issue 11).

A model with a frozen parameter, a persistent buffer, a rotary table (non-persistent buffer) and
BatchNorm running statistics, under `dp` 2: the data-parallel all-reduce moves exactly the
trainable parameters' gradients (plus the reducer's documented "has a gradient" flag, one element
per parameter: runtime/reducer.py), with and without ZeRO; ZeRO shards only the trainable
parameters; the frozen parameter and the buffers stay untouched and get no gradient.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from launch import run_workers
from nnscaler.runtime.optimizer_state import optimizer_state


DIM = 8


class WithNoGradTensors(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.fc = nn.Linear(DIM, DIM)
        self.bn = nn.BatchNorm1d(DIM)  # weight, bias trainable; running statistics are buffers
        self.head = nn.Linear(DIM, 1, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))
        pos = torch.arange(DIM, dtype=torch.float32)
        self.register_buffer("rotary", torch.cos(pos / 4), persistent=False)

    def forward(self, x, y):
        h = self.frozen(x) * self.rotary
        h = self.bn(torch.relu(self.fc(h))) * self.scale
        return nn.functional.mse_loss(self.head(h).squeeze(-1), y)


def _batch(n, rank):
    g = torch.Generator().manual_seed(3 + rank)
    return {"x": torch.randn(n, DIM, generator=g), "y": torch.randn(n, generator=g)}


def _job(rank, world, gen_dir, zero):
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from nnscaler.runtime import comm
    torch.manual_seed(0)
    model = WithNoGradTensors()
    cfg = ComputeConfig(1, world, trace_strategy="cpu", use_zero=zero, zero_use_reduce_scatter=zero)
    pm = parallelize(model, _batch(4, rank), "dp", cfg, gen_savedir=gen_dir, instance_name=f"nograd_{zero}")
    opt = build_optimizer(pm, torch.optim.Adam, lr=1e-2)
    trainable = [p for p in pm.parameters() if p.requires_grad]
    frozen_before = [p.detach().clone() for p in pm.parameters() if not p.requires_grad]
    with comm.count_collectives() as stats:
        loss = pm(**_batch(4, rank))
        opt.zero_grad()
        loss.backward()
        opt.step()
    engine = optimizer_state(opt).zero
    return {
        "snapshot": stats.snapshot(),
        "trainable_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "trainable_count": len(trainable),
        "elem": trainable[0].element_size(),
        "frozen_count": len(frozen_before),
        "frozen_unchanged": all(torch.equal(a, p) for a, p in
                                zip(frozen_before, [p for p in pm.parameters() if not p.requires_grad])),
        "frozen_no_grad": all(p.grad is None for p in pm.parameters() if not p.requires_grad),
        "buffers_no_grad": all(not b.requires_grad and b.grad is None for b in pm.buffers()),
        "zero_tensors_trainable": None if engine is None else
        {id(zp.param) for zp in engine.params} == {id(p) for p in trainable},
        "reducer_tensors": None if pm.reducer is None else
        sorted(id(p) for b in pm.reducer.buckets for p in b) == sorted(id(p) for p in trainable),
    }


@pytest.mark.multiprocess
def test_data_parallel_sync_moves_only_trainable_gradients(tmp_path):
    for zero in (False, True):
        results = run_workers(_job, 2, str(tmp_path / "gen"), zero, timeout=120)
        for rank, res in enumerate(results):
            where = f"zero={zero} rank {rank}"
            assert res["frozen_count"] == 2 and res["trainable_count"] == 5, where  # frozen.weight/bias
            assert res["frozen_unchanged"] and res["frozen_no_grad"] and res["buffers_no_grad"], where
            snap = res["snapshot"]
            if not zero:
                assert res["reducer_tensors"] is True, where
                flags = res["trainable_count"] * res["elem"]  # one "has a gradient" flag per parameter
                assert snap["dp_all_reduce"]["bytes"] == res["trainable_bytes"] + flags, (where, snap)
                assert set(snap) == {"dp_all_reduce"}, (where, snap)
            else:
                assert res["zero_tensors_trainable"] is True, where
                assert "dp_all_reduce" not in snap, (where, snap)  # ZeRO reduce-scatters instead
                # one bucket (a small model): the group size (2) rows of one shard of the flat
                # trainable gradients (ceil(numel / 2)) plus one "has a gradient" flag per parameter
                numel = res["trainable_bytes"] // res["elem"]
                want = 2 * (-(-numel // 2) + res["trainable_count"]) * res["elem"]
                assert snap["zero_reduce_scatter"]["bytes"] == want, (where, snap)
