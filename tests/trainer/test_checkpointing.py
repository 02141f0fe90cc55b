"""Checkpoints through nnscaler.ckpt: layout, last / best, keep_last_n, exact resume (RNG and data
position), a finished run re-run, resume from merged, on one process."""
from __future__ import annotations

import json
import os

import pytest
import torch

from loop_helpers import config, run_trainer
from parity import assemble_full

import nnscaler.ckpt as ckpt  # noqa: E402


def run(tmp, **over):
    base = {"checkpoint.no_save": False, "model.args.dropout": 0.1}
    base.update(over)
    losses, pieces, calls = run_trainer(config(tmp, **base))
    return losses, assemble_full([(0, pieces)], "run"), calls


def strip_rng(path):
    """Delete every RNG state from a checkpoint's manifest (nnscaler.ckpt's and the Trainer's)."""
    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as f:
        manifest = json.load(f)
    for entry in manifest["ranks"]:
        entry.pop("rng", None)
        entry["extra"]["nnscaler_trainer"].pop("rng", None)
    with open(mpath, "w") as f:
        json.dump(manifest, f)


def test_layout_last_best_keep_last_n(tmp_path):
    _, _, calls = run(tmp_path, max_train_steps=6, **{"checkpoint.every_n_train_steps": 2,
                                                     "checkpoint.keep_last_n_checkpoints": 2})
    root = tmp_path / "ckpt"
    numbered = sorted(n for n in os.listdir(root) if n[0].isdigit())
    assert os.path.islink(root / "last") and os.readlink(root / "last") == "0001-0006"  # step 6 ends in epoch 1
    best = os.readlink(root / "best")
    assert best in ("0000-0002", "0000-0004", "0001-0006")
    # keep_last_n=2 prunes the oldest, but never what best points to
    assert numbered == sorted({"0000-0004", "0001-0006", best})
    assert calls.count("on_save_checkpoint") == 3
    assert (root / "0001-0006" / "manifest.json").exists()


def test_exact_resume_bitwise_and_rng_matters(tmp_path):
    straight, w_straight, _ = run(tmp_path / "a", max_train_steps=20, **{"checkpoint.no_save": True})
    first, _, _ = run(tmp_path / "b", max_train_steps=10, **{"checkpoint.every_n_train_steps": 10})
    assert first == straight[:10]
    second, w_resumed, calls = run(tmp_path / "b", max_train_steps=20, **{"checkpoint.resume_from": "last"})
    assert ("loaded", {"saved_at": 10}) in calls  # on_save_checkpoint data comes back
    assert second == straight[10:]  # bitwise: dropout masks, data order mid-epoch, Adam state
    assert all(torch.equal(w_resumed[n], w_straight[n]) for n in w_straight)
    # the same resume with the RNG states deleted from the checkpoint differs
    run(tmp_path / "c", max_train_steps=10, **{"checkpoint.every_n_train_steps": 10})
    strip_rng(os.path.realpath(tmp_path / "c" / "ckpt" / "last"))
    with pytest.warns(Warning):
        third, _, _ = run(tmp_path / "c", max_train_steps=20, **{"checkpoint.resume_from": "last"})
    assert third != straight[10:]


def test_finished_run_trains_and_rewrites_nothing(tmp_path):
    run(tmp_path, max_train_steps=4, **{"checkpoint.every_n_train_steps": 2})
    last = os.path.realpath(tmp_path / "ckpt" / "last")
    stamp = os.stat(os.path.join(last, "manifest.json")).st_mtime_ns
    losses, _, calls = run(tmp_path, max_train_steps=4, **{"checkpoint.every_n_train_steps": 2,
                                                          "checkpoint.resume_from": "last"})
    assert losses == [] and "on_save_checkpoint" not in calls
    assert os.stat(os.path.join(last, "manifest.json")).st_mtime_ns == stamp


def test_resume_from_merged_and_missing_last(tmp_path):
    from nnscaler.trainer import Trainer
    run(tmp_path, max_train_steps=4, **{"checkpoint.every_n_train_steps": 4, "checkpoint.save_type": "deduped"})
    merged = tmp_path / "merged"
    Trainer.merge_checkpoint([str(tmp_path / "ckpt" / "last")], str(merged))
    assert (merged / "model.safetensors").exists()
    losses, _, _ = run(tmp_path / "m", max_train_steps=6, **{"checkpoint.resume_from": str(merged)})
    assert len(losses) == 2  # counters restored: steps 5 and 6 only
    fresh, _, _ = run(tmp_path / "n", max_train_steps=2, **{"checkpoint.resume_from": "last"})
    assert len(fresh) == 2  # 'last' absent: a fresh start, no error
