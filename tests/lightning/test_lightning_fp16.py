"""fp16 precisions with a grad scaler (NnScalerPrecision "16-mixed" and "16-true") on 2 real gloo
processes: they train like Lightning's DDP with its own fp16 plugin, and the scaler's state
survives a checkpoint."""
from __future__ import annotations

import pytest
import torch

from launch import run_workers
import precision_workers

# dp2: the same fp16 ops as DDP, and a power-of-2 scale is exact, so within 1e-5 (equal here).
# tp2 splits the matmuls and sums partial results in another order; fp16 keeps ~3 significant
# digits (one ulp at a loss of 1.4 is 1e-3): within 5e-3
TOL = {"dp2": 1e-5, "tp2": 5e-3}


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_fp16_precisions_match_ddp(tmp_path, precision):
    kwargs = dict(gradient_clip_val=1.0, gradient_clip_algorithm="norm")
    result = run_workers(precision_workers.parity, 2, str(tmp_path), precision, kwargs, timeout=240)[0]
    ref_losses, ref_weights = result["ddp"]
    assert len(ref_losses) == 8 and ref_losses[-1] < ref_losses[0]
    for name in ("dp2", "tp2"):
        losses, weights, dtypes, logits_dtype, scaler = result[name]
        torch.testing.assert_close(losses, ref_losses, atol=TOL[name], rtol=0, msg=lambda m: f"{name} losses: {m}")
        for key, ref in ref_weights.items():
            torch.testing.assert_close(weights[key], ref, atol=TOL[name], rtol=0, msg=lambda m: f"{name} {key}: {m}")
        assert logits_dtype == "torch.float16", name  # the forward ran in fp16
        want = "torch.float16" if precision == "16-true" else "torch.float32"
        assert set(dtypes.values()) == {want}, dtypes
        # 8 steps with growth_interval=2 and no overflow: the scale doubled 4 times
        assert scaler["scale"] == 2.0 ** 10 * 2 ** 4, scaler


@pytest.mark.multiprocess
def test_scaler_state_survives_a_checkpoint(tmp_path):
    r = run_workers(precision_workers.scaler_resume, 2, str(tmp_path), "16-mixed", timeout=240)[0]
    assert r["saved"]["scale"] != 2.0 ** 10  # the scale moved during the first fit
    assert r["restored"] == r["saved"]
    assert r["resumed"] == r["straight"]
    torch.testing.assert_close(r["resumed_losses"], r["straight_losses"][8:], atol=1e-5, rtol=0)


def test_fp16_cpu_ops_this_build_supports():
    """What the fp16 tests rely on, on this CPU build: fp16 matmul, cross entropy, autocast, and
    torch.amp.GradScaler('cpu')."""
    x = torch.randn(8, 16, dtype=torch.half)
    lin = torch.nn.Linear(16, 4).half()
    loss = torch.nn.functional.cross_entropy(lin(x), torch.randint(0, 4, (8,)))
    loss.backward()
    assert loss.dtype == torch.float16 and lin.weight.grad.dtype == torch.float16
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.nn.Linear(16, 4)(x.float()).dtype == torch.float16
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler.scale((p * 3).sum()).backward()
    assert torch.equal(p.grad, torch.full((2,), 12.0))
    scaler.step(opt)
    scaler.update()
    torch.testing.assert_close(p.detach(), torch.full((2,), -2.0))


@pytest.mark.multiprocess
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    out = run_workers(precision_workers.overflow_on_one_rank, 2, timeout=60)
    for rank in (0, 1):
        assert out[rank]["ours"] == ([1.0, 1.0], 2.0), out[rank]  # not stepped, scale halved
        assert "Attempting to unscale FP16 gradients" in out[rank]["torch"]  # why 16-true needs ours
