"""Fabric with nnscaler's strategy in fp16 (NnScalerPrecision "16-mixed" / "16-true", grad scaler)
against Fabric's DDPStrategy with its own fp16 plugin, on 2 gloo processes; the scaler's state
goes through fabric.save / fabric.load; also with dp2 + ZeRO."""
from __future__ import annotations

import pytest
import torch

from launch import run_workers
import fabric_precision_workers

# dp2: the same fp16 ops as DDP and an exact power-of-2 scale; tp2 splits the matmuls and sums
# in another order, and fp16 keeps ~3 significant digits; dp2 + ZeRO: the scaler unscales the
# ZeRO shard gradients, the same ops as dp2 except the clipping norm, summed over the shards in
# another order: fp16 weights (16-true) may round one ulp apart (a relative 2**-10)
TOL = {"dp2": 1e-5, "tp2": 5e-3, "dp2-zero": 1e-5}
RTOL = {("dp2-zero", "16-true"): 2.0 ** -10}


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_fabric_fp16_matches_ddp(tmp_path, precision):
    result = run_workers(fabric_precision_workers.parity, 2, str(tmp_path), precision, timeout=240)[0]
    ref_losses, ref_weights = result["ddp"]
    assert len(ref_losses) == 4 and ref_losses[-1] < ref_losses[0]
    for name in ("dp2", "tp2", "dp2-zero"):
        losses, weights, dtypes, out_dtype, saved, changed, loaded = result[name]
        torch.testing.assert_close(losses, ref_losses, atol=TOL[name], rtol=0, msg=lambda m: f"{name} losses: {m}")
        for key, ref in ref_weights.items():
            torch.testing.assert_close(weights[key], ref, atol=TOL[name], rtol=RTOL.get((name, precision), 0),
                                       msg=lambda m: f"{name} {key}: {m}")
        assert dtypes == {"torch.float16" if precision == "16-true" else "torch.float32"}, dtypes
        assert out_dtype == "torch.float32"  # Fabric casts outputs back to the default dtype
        assert saved["scale"] == 2.0 ** 10 * 2 ** 2, saved  # 4 steps, growth_interval=2
        assert changed["scale"] == 3.0 and loaded == saved
