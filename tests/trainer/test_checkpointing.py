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


def test_a_checkpoint_with_the_former_trainer_rng_resumes_bitwise(tmp_path):
    """Checkpoints written before nnscaler.ckpt alone kept the RNG states also held them, as JSON
    lists, in the Trainer's extra: they still resume bitwise (from nnscaler.ckpt's copy)."""
    straight, _, _ = run(tmp_path / "a", max_train_steps=14, **{"checkpoint.no_save": True})
    run(tmp_path / "b", max_train_steps=7, **{"checkpoint.every_n_train_steps": 7})
    mpath = os.path.join(os.path.realpath(tmp_path / "b" / "ckpt" / "last"), "manifest.json")
    with open(mpath) as f:
        manifest = json.load(f)
    for entry in manifest["ranks"]:
        entry["extra"]["nnscaler_trainer"]["rng"] = {"0": {"torch": [0] * 8, "python": [3, [1, 2], None]}}
    with open(mpath, "w") as f:
        json.dump(manifest, f)
    second, _, _ = run(tmp_path / "b", max_train_steps=14, **{"checkpoint.resume_from": "last"})
    assert second == straight[7:]


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


def test_each_checkpoint_keeps_the_config_of_the_run_that_wrote_it(tmp_path):
    import yaml
    run(tmp_path, max_train_steps=4, **{"checkpoint.every_n_train_steps": 2})
    root = tmp_path / "ckpt"
    first = (root / "0000-0004" / "train_config.yaml").read_text()
    assert yaml.safe_load(first)["max_train_steps"] == 4
    assert "train_config.yaml" in ckpt.verify(root / "0000-0004")["files"]  # committed and hashed with it
    assert not (root / "train_config.yaml").exists()  # no shared copy a later run could overwrite
    run(tmp_path, max_train_steps=6, **{"checkpoint.every_n_train_steps": 2, "checkpoint.resume_from": "last"})
    assert yaml.safe_load((root / "0001-0006" / "train_config.yaml").read_text())["max_train_steps"] == 6
    assert (root / "0000-0004" / "train_config.yaml").read_text() == first


def test_a_step_directory_never_holds_two_runs_and_last_never_moves_back(tmp_path):
    from nnscaler.trainer import CheckpointConfig, TrainerError
    from nnscaler.trainer.checkpointing import CheckpointManager
    (tmp_path / "0000-0004").mkdir()
    os.symlink("0000-0004", tmp_path / "last")
    manager = CheckpointManager(CheckpointConfig(save_dir=str(tmp_path)))
    for step in (4, 2):  # the same step, or an older one (last would move back to it)
        with pytest.raises(TrainerError, match=rf"cannot save step {step} in .*: it holds 0000-0004 from another run"):
            manager.check_step(step)
    assert manager.check_step(6) is True
    manager.resumed_at(4)  # the checkpoint this run continues from: saved already, not refused
    assert manager.check_step(4) is False


def test_a_resumed_run_takes_the_lr_scheduler_arguments_of_its_config(tmp_path):
    import loop_helpers

    def cosine(t_max):
        return {"type": "torch.optim.lr_scheduler.CosineAnnealingLR", "args": {"T_max": t_max, "eta_min": 0.001},
                "interval": "step"}
    hook = {"before_log_train_metrics": "loop_helpers.record_lr"}
    run(tmp_path, max_train_steps=4, lr_scheduler=cosine(4), hook=hook, **{"checkpoint.every_n_train_steps": 4})
    loop_helpers.LRS.clear()
    run(tmp_path, max_train_steps=8, lr_scheduler=cosine(8), hook=hook, **{"checkpoint.resume_from": "last"})
    # the schedule reached eta_min at step 4 and stays there: it does not climb back up (T_max 4 would)
    assert loop_helpers.LRS == pytest.approx([0.001] * 4)
