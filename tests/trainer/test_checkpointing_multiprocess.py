"""Checkpoints on real gloo processes: dp2 exact resume (bitwise) from ``checkpoint.async_save``
checkpoints (the synchronous run's, with last / best / keep_last_n moved once committed), deduped +
resume on another world size (reshard on load)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch import run_workers
from loop_helpers import async_worker, config, run_trainer, worker
from parity import assemble_full

pytestmark = pytest.mark.multiprocess
import nnscaler.ckpt as ckpt  # noqa: E402


def dp2(tmp, **over):
    base = {"compute_config.runtime_ngpus": 2, "checkpoint.no_save": False, "model.args.dropout": 0.1}
    base.update(over)
    return config(tmp, **base)


def _tensors(path):
    return {f.name: load_file(str(f)) for f in sorted(Path(path).glob("*.safetensors"))}


def _listing(save_dir):
    names = sorted(os.listdir(save_dir))
    return ([n for n in names if n[0].isdigit()], os.readlink(save_dir / "last"), os.readlink(save_dir / "best"),
            [n for n in names if n.startswith(".")])


def _assert_same_checkpoints(save_dir, ref_dir):
    """Every numbered checkpoint in save_dir holds the tensors of ref_dir's of the same name, bitwise."""
    for name in _listing(save_dir)[0]:
        got, ref = _tensors(save_dir / name), _tensors(ref_dir / name)
        assert sorted(got) == sorted(ref) and ref, name
        for file, tensors in ref.items():
            assert sorted(got[file]) == sorted(tensors), (name, file)
            for key, value in tensors.items():
                assert got[file][key].equal(value), (name, file, key)  # bitwise


def test_dp2_async_save_and_resume_are_bitwise(tmp_path):
    """An uninterrupted synchronous run of 12 steps against one of 6 steps with async_save (a
    checkpoint every 2 steps, keep_last_n_checkpoints 1) resumed (resume_from: auto) to 12: the
    same checkpoints bitwise, last / best / pruning as the synchronous rules have them, no staging
    directory left, the same losses and final weights bitwise. Each rank's background writer is
    running before the first save (the Trainer prepared it at set-up, before Adam's first step) and
    no save makes a buffer or starts a process: one buffer, one process per rank and run."""
    from nnscaler.trainer.checkpoints import checkpoint_state, list_checkpoints
    every2 = {"checkpoint.every_n_train_steps": 2}
    straight = run_workers(worker, 2, dp2(tmp_path / "a", max_train_steps=12, **every2), timeout=180)
    sync = tmp_path / "a" / "ckpt"
    names = {s: os.path.basename(p) for _, s, p in list_checkpoints(str(sync))}
    assert sorted(names) == [2, 4, 6, 8, 10, 12]
    loss = {s: checkpoint_state(str(sync / n))["last_val_loss"] for s, n in names.items()}

    def expected(last):  # the newest, and the best (is_better: lowest loss, a tie to the newer one)
        best = names[min((s for s in names if s <= last), key=lambda s: (loss[s], -s))]
        return sorted({names[last], best}), names[last], best, []
    asynch = {**every2, "checkpoint.async_save": True, "checkpoint.keep_last_n_checkpoints": 1}
    first = run_workers(async_worker, 2, dp2(tmp_path / "b", max_train_steps=6, **asynch), timeout=180)
    save_dir = tmp_path / "b" / "ckpt"
    assert _listing(save_dir) == expected(6)
    _assert_same_checkpoints(save_dir, sync)
    resumed = run_workers(async_worker, 2, dp2(tmp_path / "b", max_train_steps=12, **asynch, **{
        "checkpoint.resume_from": "auto"}), timeout=180)
    for run in (first, resumed):
        for rank, (_, seen) in enumerate(run):
            assert len(seen) == 3, (rank, seen)  # steps 2, 4, 6 (8, 10, 12 resumed)
            pid = seen[0][0][1]
            assert all(before == (True, pid, 1) and after == (pid, 1) for before, after in seen), (rank, seen)
    resumed = [r for r, _ in resumed]
    assert _listing(save_dir) == expected(12)
    _assert_same_checkpoints(save_dir, sync)
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
