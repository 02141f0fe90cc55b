"""Guards and both-branch decisions on 2 real gloo processes (nnscaler.runtime.guards).

A guard that fails on one data-parallel rank only raises GuardError on every rank (nobody hangs:
the run has a timeout, and the ranks stay in step: a later forward runs); a no_grad forward on
one rank alone does not wait for the others; a pipelined plan fails
the step on every rank through its failure notice; the toy of Hugging Face's mask pattern, traced
with padding, trains on padded, unpadded and mixed batches (dp rank 0 padded, rank 1 not) like
one process (float64) under dp 2 and tp 2; its padded branch holds a guard of its own, which every
rank checks (and agrees on) whichever branch its data took, so the mixed batch does not leave one
rank in the guard's all-reduce and the other in the gradients'.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from guard_models import AssertMask, HFMaskAttention, ItemScale, PipeGuard, mask_batch
from launch import error_of, run_workers

STEPS = 3
LR = 1e-2


def _line_of(cls, text):
    lines, start = inspect.getsourcelines(cls.forward)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _x(seed, n=2):
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))


def _mixed_batch(step, n):
    """Padding in the first half of the batch only: dp rank 0 pads, rank 1 does not."""
    batch = mask_batch(step, n, padded=False)
    batch["attention_mask"][: n // 2, -2:] = 0
    return batch


BATCHES = {0: lambda s, n: mask_batch(s, n, True), 1: lambda s, n: mask_batch(s, n, False), 2: _mixed_batch}


def _hf_reference(dp):
    torch.manual_seed(0)
    model = HFMaskAttention(right_padded=True).double()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        full = BATCHES[step](step, 4)
        per = 4 // dp
        loss = sum(model(**{k: v[r * per:(r + 1) * per] for k, v in full.items()}) for r in range(dp)) / dp
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _train_hf(rank, world, policy, plan, gen_dir):
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from parity import train_steps

    dp = world // plan
    torch.manual_seed(0)
    pm = parallelize(HFMaskAttention(right_padded=True).double(), mask_batch(0, 4 // dp, True), policy,
                     ComputeConfig(plan, world, trace_strategy="cpu"), gen_savedir=gen_dir,
                     instance_name=f"hf_{policy}_{plan}")
    opt = build_optimizer(pm, torch.optim.Adam, lr=LR)
    losses = train_steps(pm, opt, lambda step, n: BATCHES[step](step, n), steps=STEPS, global_batch=4,
                         dp_rank=rank // plan, dp=dp)
    shards = [(e.full_name, e.full_shape, e.slices, getattr(pm, local).detach().clone())
              for local, e in pm.fullmap.items() if isinstance(getattr(pm, local), torch.nn.Parameter)]
    return losses, shards


def _guard_on_one_rank(rank, world, gen_dir):
    from nnscaler import ComputeConfig, parallelize

    torch.manual_seed(0)
    cfg = ComputeConfig(1, world, trace_strategy="cpu")
    assert_pm = parallelize(AssertMask(), {"x": _x(0), "mask": torch.ones(2, 8)}, "dp", cfg, gen_savedir=gen_dir,
                            instance_name="assert")
    item_pm = parallelize(ItemScale(), {"x": _x(0), "n": torch.tensor([1, 3])}, "dp", cfg, gen_savedir=gen_dir,
                          instance_name="item")
    mask = torch.ones(2, 8)
    if rank == 1:
        mask[0, 0] = 0  # only rank 1's data takes the other branch
    out = {"ok": error_of(lambda: assert_pm(_x(rank), torch.ones(2, 8))),
           "bool": error_of(lambda: assert_pm(_x(rank), mask)),
           "item": error_of(lambda: item_pm(_x(rank), torch.tensor([1, 3 if rank == 0 else 5]))),
           "after": error_of(lambda: assert_pm(_x(rank), torch.ones(2, 8)))}  # the ranks are still in step
    if rank == 0:  # evaluation on one rank alone (no_grad, data-parallel only): no agreement, no hang
        with torch.no_grad():
            out["alone"] = error_of(lambda: assert_pm(_x(0), torch.ones(2, 8)))
    out["hf_dp"] = _train_hf(rank, world, "dp", 1, gen_dir)
    out["hf_tp"] = _train_hf(rank, world, "tp", 2, gen_dir)
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_guards_and_branches_on_two_ranks(tmp_path):
    from parity import assemble_full

    results = run_workers(_guard_on_one_rank, 2, str(tmp_path / "gen"), timeout=240)
    line = f"guard_models.py:{_line_of(AssertMask, 'assert line')}"
    for rank, res in enumerate(results):
        assert res["ok"] is None and res["after"] is None and res.get("alone") is None, (rank, res)
        ours, kind, msg = res["bool"]
        assert ours and kind == "GuardError" and line in msg, (rank, msg)
        ours, kind, msg = res["item"]
        assert ours and kind == "GuardError" and "tensor.item()" in msg, (rank, msg)
    assert "it is False now (rank 1)" in results[1]["bool"][2]
    assert "differs now on rank 1 (this rank, 0, matched" in results[0]["bool"][2]
    assert "it is 5 now (rank 1)" in results[1]["item"][2] and "differs now on rank 1" in results[0]["item"][2]
    for key, dp in (("hf_dp", 2), ("hf_tp", 1)):
        ref_losses, ref_params = _hf_reference(dp)
        losses = results[0][key][0]
        assert losses == results[1][key][0]
        for got, want in zip(losses, ref_losses):
            assert abs(got - want) <= 1e-10 * abs(want), (key, losses, ref_losses)
        full = assemble_full(((r, res[key][1]) for r, res in enumerate(results)), key)
        for name, want in ref_params.items():
            err = ((full[name] - want).norm() / want.norm()).item()
            assert err <= 1e-10, (key, name, err)


def _pipelined_guard(rank, world, gen_dir):
    from nnscaler import ComputeConfig, parallelize

    torch.manual_seed(0)
    cfg = ComputeConfig(2, 2, trace_strategy="cpu", use_end2end=True,
                        pas_config={"pipeline_nmicros": 2, "pipeline_scheduler": "1f1b"})
    pm = parallelize(PipeGuard(), {"x": _x(0), "mask": torch.ones(2, 8)}, "pp", cfg, gen_savedir=gen_dir)
    bad = torch.ones(2, 8)
    bad[1, 1] = 0
    ok = error_of(lambda: pm.train_step([{"x": _x(1), "mask": torch.ones(2, 8)}] * 2))
    failed = error_of(lambda: pm.train_step([{"x": _x(2), "mask": torch.ones(2, 8)}, {"x": _x(3), "mask": bad}]))
    _store_barrier(world)  # both stay alive until both are done; a rank left waiting would time out the run
    return dict(ok=ok, failed=failed)


def _store_barrier(world):
    """Wait for every rank through the rendezvous store (a gloo barrier would sit behind the
    failed step's abandoned messages)."""
    import time
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.add("guard_test_done", 1)
    while store.add("guard_test_done", 0) < world:
        time.sleep(0.05)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pipelined_guard_fails_the_step_on_every_rank(tmp_path):
    first, last = run_workers(_pipelined_guard, 2, str(tmp_path / "gen"), timeout=90)
    assert first["ok"] is None and last["ok"] is None
    failed = [r["failed"] for r in (first, last)]
    assert all(f is not None and f[0] for f in failed), failed
    line = f"guard_models.py:{_line_of(PipeGuard, 'pipelined guard line')}"
    own = next(f for f in failed if f[1] == "GuardError")  # the stage that runs the guard
    assert line in own[2] and "it is False now" in own[2], own
    other = next(f for f in failed if f is not own)  # told by the failure notice, not left waiting
    assert other[1] == "NnScalerError" and "pipeline rank 1 failed in stage 1, micro-batch 1" in other[2], other


