"""The same config on dp (1 process), dp2, tp2, pp2 and tp2 x dp2 + ZeRO (real gloo processes)
gives the same weights."""
from __future__ import annotations

import pytest
import torch

from launch import run_workers
from loop_helpers import config, run_trainer, worker
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
    for label, data in runs.items():
        world = data["compute_config"]["runtime_ngpus"]
        results = run_workers(worker, world, data, timeout=240)
        full = assemble_full([(r, pieces) for r, (_, pieces, _) in enumerate(results)], label)
        assert set(full) == set(ref), label
        for name in ref:
            torch.testing.assert_close(full[name], ref[name], atol=1e-5, rtol=0, msg=lambda m: f"{label}: {m}")
        if results[0][0]:  # losses recorded by the hook: the same on every rank, equal to dp1's
            assert results[0][0] == pytest.approx(ref_losses, abs=1e-5), label
            assert all(r[0] == results[0][0] for r in results)
