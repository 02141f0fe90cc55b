"""fp16 precisions with ZeRO (ComputeConfig(use_zero=True)) on 2 real gloo processes: the grad
scaler unscales the ZeRO shard gradients the optimizer steps on, so 16-mixed / 16-true with dp2 +
ZeRO train like Lightning's DDP with its own fp16 plugin; an overflow, on every rank or in one
rank's shard only, skips the step on every rank and lowers the scale."""
from __future__ import annotations

import pytest
import torch

from launch import run_workers
import precision_workers

# dp2: the same fp16 ops as DDP, power-of-2 scales are exact (test_lightning_fp16's dp2 tolerance);
# only the clipping norm is summed over ZeRO's shards in another order, so fp16 weights (16-true)
# may round one ulp apart (a relative 2**-10; equal in practice here)
TOL = 1e-5
RTOL = {"16-mixed": 0, "16-true": 2.0 ** -10}


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_fp16_with_zero_matches_ddp(tmp_path, precision):
    kwargs = dict(gradient_clip_val=1.0, gradient_clip_algorithm="norm")
    configs = [("dp2-zero", None)]
    if precision == "16-mixed":
        configs.append(("dp2-zero-rs", {"zero_use_reduce_scatter": True}))
    out = run_workers(precision_workers.zero_parity, 2, str(tmp_path), precision, kwargs, configs, timeout=300)[0]
    ref_losses, ref_weights = out["ddp"]
    assert len(ref_losses) == 8 and ref_losses[-1] < ref_losses[0]
    for name, _ in configs:
        r = out[name]
        assert r["zero"] and r["syncs"] >= 8, name  # ZeRO's shard gradients set once per step
        torch.testing.assert_close(r["losses"], ref_losses, atol=TOL, rtol=0, msg=lambda m: f"{name} losses: {m}")
        for key, ref in ref_weights.items():
            torch.testing.assert_close(r["weights"][key], ref, atol=TOL, rtol=RTOL[precision],
                                       msg=lambda m: f"{name} {key}: {m}")
        want = "torch.float16" if precision == "16-true" else "torch.float32"
        assert set(r["dtypes"].values()) == {want}, r["dtypes"]
        # 8 steps with growth_interval=2 and no overflow: the scale doubled 4 times
        assert r["scaler"]["scale"] == 2.0 ** 10 * 2 ** 4, r["scaler"]


@pytest.mark.multiprocess
def test_fp16_zero_overflow_skips_the_step_on_every_rank(tmp_path):
    out = run_workers(precision_workers.zero_overflow, 2, str(tmp_path), timeout=240)
    for rank, r in enumerate(out):
        huge = r["huge"]
        assert huge["batches"] == 3 and huge["scale"] == 2.0 ** 40 * 0.5 ** 3  # halved at each skipped step
        assert huge["state"] == 0  # SGD never stepped: no momentum buffer
        assert huge["shard_numel"] < huge["module_numel"]  # the optimizer holds this rank's ZeRO shard
        for k, v in huge["initial"].items():
            assert torch.equal(huge["weights"][k], v), f"rank {rank}: {k} changed"
        record = r["one_rank"]
        assert len(record) == 4
        scales = [s for s, _ in record]
        sums = [w for _, w in record]
        # batch 2 (rank 1 alone found the inf): skipped on this rank too, the scale halved
        assert sums[2] == sums[1], f"rank {rank} stepped at the overflow"
        assert scales[2] == scales[1] / 2, scales
        assert sums[1] != sums[0] and sums[3] != sums[2]  # the other batches step
    assert out[0]["one_rank"] == out[1]["one_rank"]  # the ranks agree on every scale and weight
