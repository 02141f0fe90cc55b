"""NnScalerStrategy(cpu_offload=True) on 2 real gloo processes: the optimizer steps on fp32
copies on the CPU (offload.py), and training equals Lightning's DDP within 1e-5 at dp2, tp2 and
dp2 + ZeRO (with an LR scheduler, gradient accumulation and clipping by norm); the optimizer's
state tensors are not the module's parameters; save / resume works with it; Fabric too. The CPU
is both the training and the offload device here: the same code path copies GPU -> CPU on CUDA."""
from __future__ import annotations

import pytest
import torch

from launch import run_workers
import offload_workers

TOL = 1e-5


def _close(a, b, what):
    torch.testing.assert_close(a, b, atol=TOL, rtol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.multiprocess
def test_cpu_offload_matches_ddp_with_scheduler_accumulation_and_clipping(tmp_path):
    kwargs = dict(accumulate_grad_batches=2, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
    out = run_workers(offload_workers.parity, 2, str(tmp_path), kwargs, timeout=300)[0]
    ref = out["ddp"]
    assert len(ref["losses"]) == 8 and ref["lr"] == pytest.approx(1e-2 * 0.25)  # StepLR stepped twice
    for name in ("dp2", "tp2", "dp2-zero"):
        r = out[name]
        assert r["offloaded"] and r["device"] == "cpu", name
        assert r["n_states"] > 0 and r["state_devices"] == {"cpu"} and r["state_dtypes"] == {"torch.float32"}
        assert not r["state_shares_module_memory"], f"{name}: optimizer state aliases the module's parameters"
        assert not r["group_shares_module_memory"] and not r["group_is_module_params"], name
        assert r["lr"] == ref["lr"], name  # the scheduler drives the offloaded optimizer
        _close(r["losses"], ref["losses"], f"{name} losses")
        assert set(r["weights"]) == set(ref["weights"]), name
        for key, value in ref["weights"].items():
            _close(r["weights"][key], value, f"{name} {key}")
    # Adam: 2 moments per element; ZeRO keeps this rank's half only
    assert out["dp2"]["state_numel"] == 2 * out["dp2"]["module_numel"]
    assert out["dp2-zero"]["zero"] and out["dp2-zero"]["state_numel"] < out["dp2"]["state_numel"]


@pytest.mark.multiprocess
def test_cpu_offload_resume_equals_straight(tmp_path):
    out = run_workers(offload_workers.resume, 2, str(tmp_path), timeout=300)
    for r in out:
        straight, first, second, plain = r["straight"], r["first"], r["second"], r["plain"]
        assert "manifest.json" in r["saved"]
        assert first["step"] == 8 and second["step"] == straight["step"] == plain["step"] == 16
        assert second["held"]["offloaded"] and not plain["held"]["offloaded"]
        assert not second["held"]["state_shares_module_memory"]
        for label, run in (("resumed", second), ("resumed without offload", plain)):
            assert len(run["losses"]) == 8
            _close(run["losses"], straight["losses"][8:], f"{label} losses")
            for k, v in straight["weights"].items():
                _close(run["weights"][k], v, f"{label} {k}")
            assert run["optim"].keys() == straight["optim"].keys() and run["optim"]
            for k, s in straight["optim"].items():
                for n, v in s.items():
                    _close(run["optim"][k][n], v, f"{label} optimizer {k}.{n}")


@pytest.mark.multiprocess
def test_fabric_cpu_offload_matches_ddp(tmp_path):
    out = run_workers(offload_workers.fabric_parity, 2, str(tmp_path), timeout=240)[0]
    ref_losses, ref_weights = out["ddp"]
    losses, weights, offloaded, n_states, shares = out["offload"]
    assert offloaded and n_states > 0 and not shares
    _close(losses, ref_losses, "fabric losses")
    for k, v in ref_weights.items():
        _close(weights[k], v, f"fabric {k}")


def test_lightning_offload_is_the_runtimes():
    """The machinery is the runtime's (tests/runtime/test_offload.py); Lightning's module keeps
    the old import path working with the same objects."""
    import nnscaler.lightning.offload as lightning_offload
    import nnscaler.runtime as runtime
    for name in ("offload_optimizer", "OffloadedOptimizer", "step_gradients"):
        assert getattr(lightning_offload, name) is getattr(runtime, name), name
