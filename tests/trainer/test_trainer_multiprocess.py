"""The same config on dp (1 process), dp2, tp2, pp2, tp2 x dp2 + ZeRO and dp2 fully sharded
(use_zero: 3, with a checkpoint and an exact resume in the same launch) gives the same weights."""
from __future__ import annotations

import pytest
import torch

from launch import run_workers
from loop_helpers import config, resume_worker, run_trainer, worker
from parity import assemble_full

pytestmark = pytest.mark.multiprocess


def test_dp1_dp2_tp2_same_weights(tmp_path):
    ref_losses, ref_pieces, _ = run_trainer(config(tmp_path / "dp1"))
    ref = assemble_full([(0, ref_pieces)], "dp1")
    runs = {
        # dp2: the sync inside the last backward (no before_sync_grad hook)
        "dp2": config(tmp_path / "dp2", hook=..., **{"compute_config.runtime_ngpus": 2}),
        # dp2 with a before_sync_grad hook: accumulate locally, hook, then sync
        "dp2-hook": config(tmp_path / "dp2h", **{"compute_config.runtime_ngpus": 2}),
        "tp2": config(tmp_path / "tp2", pas_policy="tp",
                      **{"compute_config.runtime_ngpus": 2, "compute_config.plan_ngpus": 2}),
        "pp2": config(tmp_path / "pp2", pas_policy="pp", **{
            "compute_config.runtime_ngpus": 2, "compute_config.plan_ngpus": 2,
            "compute_config.pas_config": {"pipeline_nmicros": 2}}),
        "tp2xdp2+zero": config(tmp_path / "tp2dp2", pas_policy="tp", **{
            "compute_config.runtime_ngpus": 4, "compute_config.plan_ngpus": 2, "compute_config.use_zero": True}),
    }
    # dp2 fully sharded (parameters, gradients, optimizer state): trains like dp1, and
    # 6 steps straight equal 3 + a resume from the step-3 checkpoint + 3, bitwise (losses, weights)
    zero3 = config(tmp_path / "dp2z3", **{"compute_config.runtime_ngpus": 2, "compute_config.use_zero": 3})
    runs["dp2+zero3"] = zero3
    for label, data in runs.items():
        world = data["compute_config"]["runtime_ngpus"]
        if label == "dp2+zero3":
            pairs = run_workers(resume_worker, world, data, 3, timeout=240)
            for rank, ((losses, pieces, _), (resumed_losses, resumed_pieces, calls)) in enumerate(pairs):
                assert ("loaded", {"saved_at": 3}) in calls and resumed_losses == losses[3:], rank
                assert len(resumed_pieces) == len(pieces) and resumed_pieces, rank
                for (name, _, _, a), (_, _, _, b) in zip(resumed_pieces, pieces):
                    assert torch.equal(a, b), f"dp2+zero3 resumed, rank {rank}: {name}"  # bitwise
            results = [straight for straight, _ in pairs]
        else:
            results = run_workers(worker, world, data, timeout=240)
        full = assemble_full([(r, pieces) for r, (_, pieces, _) in enumerate(results)], label)
        assert set(full) == set(ref), label
        for name in ref:
            torch.testing.assert_close(full[name], ref[name], atol=1e-5, rtol=0, msg=lambda m: f"{label}: {m}")
        if results[0][0]:  # losses recorded by the hook: the same on every rank, equal to dp1's
            assert results[0][0] == pytest.approx(ref_losses, abs=1e-5), label
            assert all(r[0] == results[0][0] for r in results)
