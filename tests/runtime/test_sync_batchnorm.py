"""ComputeConfig.sync_batchnorm: training-mode batch norm over all data-parallel replicas.

On real gloo processes: `nr.sync_batchnorm.batch_norm` with uneven local batches (one rank empty)
equals ``F.batch_norm`` on the concatenated batch (output, input / weight / bias gradients, running
statistics, float64); the ResNet-18-style model under `dp` 2 and 4 and `tp` 2 x dp 2 with ``sync_batchnorm=True``
matches one process (losses, parameters AND running statistics after 3 steps, then an eval
step), and without it the per-replica statistics really differ (what the option is for).
"""
from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from launch import run_workers
from resnet_models import ResNet, resnet_batch64, train_reference
from test_comm_inplace import merge_shards


TOL = 1e-10  # float64
C = 3


def _global(shape_tail):
    g = torch.Generator().manual_seed(7)
    x = torch.randn((10, C) + shape_tail, generator=g, dtype=torch.float64) * 2 + 1
    dy = torch.randn(x.shape, generator=g, dtype=torch.float64)
    w = torch.rand(C, generator=g, dtype=torch.float64) + 0.5
    b = torch.randn(C, generator=g, dtype=torch.float64)
    return x, dy, w, b


def _bounds(world):
    """Uneven local batches of the 10 samples; with 4 ranks rank 2 holds none."""
    return {2: [0, 3, 10], 4: [0, 1, 4, 4, 10]}[world]


def _single(shape_tail):
    """What one process computes on the whole batch: the output followed by relu (as the
    workers' relu_), the input / weight / bias gradients, the running statistics."""
    x, dy, w, b = _global(shape_tail)
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    rm, rv = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    y = F.batch_norm(x, rm, rv, w, b, True, 0.3, 1e-5).relu()
    (y * dy).sum().backward()
    return y.detach(), x.grad, w.grad, b.grad, rm, rv


def _function_job(rank, world):
    from nnscaler.runtime import RankGrid, sync_batchnorm
    module = types.SimpleNamespace(grid=RankGrid.get(1, world))
    lo, hi = _bounds(world)[rank:rank + 2]
    out = {}
    for tail in ((), (4,), (2, 3)):  # BatchNorm1d (N, C), (N, C, L); BatchNorm2d
        x, dy, w, b = _global(tail)
        x = x[lo:hi].clone().requires_grad_()
        w, b = w.clone().requires_grad_(), b.clone().requires_grad_()
        rm, rv = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
        y = sync_batchnorm.batch_norm(module, x, rm, rv, w, b, True, 0.3, 1e-5)
        y.relu_()  # an in-place op on the output is allowed
        (y * dy[lo:hi]).sum().backward()
        out[tail] = (y.detach(), x.grad, w.grad, b.grad, rm, rv)
    # eval mode is plain batch norm with the running statistics (no communication)
    from nnscaler.runtime import comm
    with comm.count_collectives() as stats:
        x, _, w, b = _global(())
        y = sync_batchnorm.batch_norm(module, x, rm, rv, w, b, False, 0.3, 1e-5)
    out["eval"] = (torch.allclose(y, F.batch_norm(x, rm, rv, w, b, False, 0.3, 1e-5)), stats.calls())
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_function_matches_one_process_with_uneven_batches(world):
    results = run_workers(_function_job, world, timeout=120)
    bounds = _bounds(world)
    for tail in ((), (4,), (2, 3)):
        y, gx, gw, gb, rm, rv = _single(tail)
        for rank, res in enumerate(results):
            lo, hi = bounds[rank:rank + 2]
            got_y, got_gx, _, _, got_rm, got_rv = res[tail]
            where = f"shape tail {tail}, rank {rank} of {world} (samples {lo}:{hi})"
            torch.testing.assert_close(got_y, y[lo:hi], atol=TOL, rtol=TOL, msg=where)
            torch.testing.assert_close(got_gx, gx[lo:hi], atol=TOL, rtol=TOL, msg=where)
            torch.testing.assert_close(got_rm, rm, atol=TOL, rtol=TOL, msg=where)
            torch.testing.assert_close(got_rv, rv, atol=TOL, rtol=TOL, msg=where)
        # weight / bias: local sums, which add up to the whole batch's gradient
        torch.testing.assert_close(sum(res[tail][2] for res in results), gw, atol=TOL, rtol=TOL)
        torch.testing.assert_close(sum(res[tail][3] for res in results), gb, atol=TOL, rtol=TOL)
    for res in results:
        assert res["eval"] == (True, 0)


# -- the ResNet-18-style model under dp, trained then evaluated -------------------------------------
STEPS = 3
BATCH = 8
LR = 1e-2


def _batch(step, n=BATCH):
    return resnet_batch64(step, n)


def _reference():
    return train_reference(STEPS, BATCH, lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9), eval_after=True)


def _dp_job(rank, world, plan, gen_dir, sync):
    import torch.distributed as dist
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    dp = world // plan
    per, dp_rank = BATCH // dp, rank // plan
    mine = lambda step: {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in _batch(step).items()}  # noqa: E731
    torch.manual_seed(0)
    cfg = ComputeConfig(plan, world, trace_strategy="cpu", sync_batchnorm=sync)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(ResNet().double(), mine(0), "dp" if plan == 1 else "tp", cfg, gen_savedir=gen_dir,
                         instance_name=f"resnet_{plan}_{world}_{sync}")
    opt = build_optimizer(pm, torch.optim.SGD, lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS + 1):
        if step == STEPS:
            pm.eval()
            with torch.no_grad():
                loss = pm(**mine(step))
        else:
            loss = pm(**mine(step))
            opt.zero_grad()
            loss.backward()
            opt.step()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    shards = [(e.full_name, e.full_shape, e.slices, getattr(pm, local).detach().clone())
              for local, e in pm.fullmap.items() if torch.is_tensor(getattr(pm, local))]
    return losses, shards


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("world,plan", [(2, 1), (4, 1), (4, 2)])  # dp 2, dp 4, tp 2 x dp 2
def test_resnet_under_dp_with_sync_batchnorm_matches_one_process(world, plan, tmp_path):
    ref_losses, ref_state = _reference()
    for sync in (True, False):
        results = run_workers(_dp_job, world, plan, str(tmp_path / "gen"), sync, timeout=500)
        losses = results[0][0]
        if not sync:  # per-replica statistics: not the single process's numbers (documented)
            assert abs(losses[0] - ref_losses[0]) > 1e-3, (losses, ref_losses)
            continue
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert abs(got - want) <= TOL * max(1.0, abs(want)), f"world {world} plan {plan} step {step}: {got} vs {want}"
        for unit in range(world // plan):  # every replica holds the single process's state
            state = merge_shards([shards for _, shards in results[unit * plan:(unit + 1) * plan]])
            assert set(state) == set(ref_state), set(state) ^ set(ref_state)
            for name, want in ref_state.items():
                got, want = state[name], want.double()
                rel = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
                assert rel <= TOL, f"world {world} plan {plan} unit {unit}: {name} differs (relative {rel:.2e})"
