"""Checkpoints on real gloo processes: dp2 exact resume (bitwise), deduped + resume on another world
size (reshard on load)."""
from __future__ import annotations

import pytest
import torch

from launch import run_workers
from loop_helpers import config, run_trainer, worker
from parity import assemble_full

pytestmark = pytest.mark.multiprocess
import nnscaler.ckpt as ckpt  # noqa: E402


def dp2(tmp, **over):
    base = {"compute_config.runtime_ngpus": 2, "checkpoint.no_save": False, "model.args.dropout": 0.1}
    base.update(over)
    return config(tmp, **base)


def test_dp2_resume_is_bitwise(tmp_path):
    straight = run_workers(worker, 2, dp2(tmp_path / "a", max_train_steps=12, **{"checkpoint.no_save": True}),
                           timeout=180)
    run_workers(worker, 2, dp2(tmp_path / "b", max_train_steps=6, **{"checkpoint.every_n_train_steps": 6}),
                timeout=180)
    resumed = run_workers(worker, 2, dp2(tmp_path / "b", max_train_steps=12, **{"checkpoint.resume_from": "last"}),
                          timeout=180)
    assert resumed[0][0] == straight[0][0][6:]
    for rank in range(2):
        for (name, _, _, a), (_, _, _, b) in zip(resumed[rank][1], straight[rank][1]):
            assert torch.equal(a, b), name


def test_deduped_dp2_resumes_on_one_process(tmp_path):
    run_workers(worker, 2, dp2(tmp_path / "a", max_train_steps=4, **{
        "model.args.dropout": 0.0, "checkpoint.every_n_train_steps": 4, "checkpoint.save_type": "deduped"}),
        timeout=180)
    with pytest.warns(Warning, match="random states start afresh"):
        losses, pieces, _ = run_trainer(config(tmp_path / "a", max_train_steps=6, **{
            "checkpoint.no_save": False, "checkpoint.resume_from": "last", "gen_savedir": str(tmp_path / "gen1")}))
    ref_losses, ref_pieces, _ = run_trainer(config(tmp_path / "ref", max_train_steps=6))
    assert losses == pytest.approx(ref_losses[4:], abs=1e-5)
    got, ref = assemble_full([(0, pieces)], "resumed"), assemble_full([(0, ref_pieces)], "ref")
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=0)
