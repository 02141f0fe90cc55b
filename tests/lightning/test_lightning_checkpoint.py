"""Checkpoints of NnScalerStrategy through nnscaler.ckpt, on 2 real gloo processes: fit 2 epochs,
save, fit(ckpt_path=...) to 4 equals 4 straight (global step, weights, optimizer state), for
sharded and deduped; the merged checkpoint resumes under another plan; ModelCheckpoint writes
checkpoint directories."""
from __future__ import annotations

import pytest
import torch

from launch import run_workers
import ckpt_workers

TOL = 1e-5


def _close_weights(a, b, what):
    assert set(a) == set(b), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=TOL, rtol=0, msg=lambda m: f"{what} {k}: {m}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("plan,kind", [(("tp2", 2, "tp"), "sharded"),
                                       (("dp2-zero3", 1, "dp", {"use_zero": 3}), "deduped")])
def test_resume_equals_straight(tmp_path, plan, kind):
    """tp2 (sharded) and dp2 fully sharded (use_zero=3: the checkpoint is written and read with
    the parameters gathered; deduped), each resumed under its own plan and, merged, under the other
    (tp2 -> dp2, dp2 use_zero=3 -> tp2)."""
    out = run_workers(ckpt_workers.resume, 2, str(tmp_path), plan, kind, timeout=240)
    for r in out:
        straight, first, second = r["straight"], r["first"], r["second"]
        assert "manifest.json" in r["saved"] and any(f.endswith(".safetensors") for f in r["saved"])
        assert first["step"] == 8 and second["step"] == straight["step"] == 16
        assert second["epoch"] == straight["epoch"] == 4
        # the resumed run trains epochs 3 and 4 only, with the losses of the straight run
        assert len(second["losses"]) == 8
        torch.testing.assert_close(second["losses"], straight["losses"][8:], atol=TOL, rtol=0)
        _close_weights(second["weights"], straight["weights"], "resumed")
        assert second["optim"].keys() == straight["optim"].keys() and second["optim"]
        for k, s in straight["optim"].items():
            for n, v in s.items():
                torch.testing.assert_close(second["optim"][k][n], v, atol=TOL, rtol=0)
        # the merged checkpoint of epoch 2, under the other plan, continues the same training
        merged = r["from_merged"]
        assert merged["step"] == 16
        torch.testing.assert_close(merged["losses"], straight["losses"][8:], atol=TOL, rtol=0)
        _close_weights(merged["weights"], straight["weights"], "from merged")


@pytest.mark.multiprocess
def test_model_checkpoint_writes_directories(tmp_path):
    out = run_workers(ckpt_workers.model_checkpoint, 2, str(tmp_path), timeout=180)
    r = out[0]
    assert r["is_dir"]
    assert "last.ckpt" in r["listing"] and "epoch=1-step=8.ckpt" in r["listing"], r["listing"]
    assert r["resumed_step"] == 12  # 2 epochs restored + 1 more of 4 steps
    torch.testing.assert_close(r["validated_val"], r["fitted_val"], atol=TOL, rtol=0)
    assert (tmp_path / "ckpts" / "epoch=0-step=4.ckpt" / "manifest.json").is_file()


def test_a_single_device_file_is_refused(tmp_path):
    from nnscaler.lightning import NnScalerLightningError
    from nnscaler.lightning.checkpoint import load
    f = tmp_path / "model.ckpt"
    f.write_bytes(b"not a directory")
    with pytest.raises(NnScalerLightningError, match=r"model.ckpt is a file; NnScalerStrategy reads checkpoint "
                                                     r"directories.*load it into the model before creating"):
        load(f, None, None)
    with pytest.raises(NnScalerLightningError, match=r"missing.ckpt is missing"):
        load(tmp_path / "missing.ckpt", None, None)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["sharded", "deduped"])
def test_checkpoint_of_another_plan_loads_directly(tmp_path, kind):
    """fit(ckpt_path=...) under dp2 from a tp2 checkpoint, without merge_checkpoint: nnscaler.ckpt
    reshards on load (weights and optimizer state)."""
    out = run_workers(ckpt_workers.other_plan, 2, str(tmp_path), kind, timeout=240)
    for r in out:
        straight, resumed = r["straight"], r["resumed"]
        assert resumed["step"] == straight["step"] == 16 and resumed["epoch"] == 4
        torch.testing.assert_close(resumed["losses"], straight["losses"][8:], atol=TOL, rtol=0)
        _close_weights(resumed["weights"], straight["weights"], "resumed under dp2")
        for k, s in straight["optim"].items():
            for n, v in s.items():
                torch.testing.assert_close(resumed["optim"][k][n], v, atol=TOL, rtol=0)
