"""The checks of a run's directories before any worker starts (nnscaler.trainer.prechecks): a
fresh start into a save_dir that holds checkpoints, an older step beside later ones, a missing
resume_from, an unusable save_dir; ``resume_from: auto``; a finished run re-run."""
from __future__ import annotations

import os

import pytest

from loop_helpers import config, run_trainer
from nnscaler.trainer import TrainerArgs, TrainerConfigError


def check_paths(args):
    from nnscaler.trainer.prechecks import check_paths
    return check_paths(args)


def nothing_to_train(args):
    from nnscaler.trainer.prechecks import nothing_to_train
    return nothing_to_train(args)


def run(tmp, **over):
    base = {"checkpoint.no_save": False, "checkpoint.every_n_train_steps": 2}
    base.update(over)
    return run_trainer(config(tmp, **base))[0]


def snapshot(root):
    """Every file and link under `root` with its content (or target) and modification time."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            if os.path.islink(p):
                out[os.path.relpath(p, root)] = ("->", os.readlink(p))
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[os.path.relpath(p, root)] = (f.read(), os.stat(p).st_mtime_ns)
    return out


def test_a_fresh_start_into_a_save_dir_with_checkpoints_is_refused_and_changes_nothing(tmp_path):
    run(tmp_path, max_train_steps=4)
    before = snapshot(tmp_path / "ckpt")
    with pytest.raises(TrainerConfigError, match=r"^checkpoint.save_dir: .*ckpt already holds checkpoints "
                                                 r"\(0000-0002, 0000-0004\) and this run would start afresh: resume "
                                                 r"them with --checkpoint.resume_from auto \(or last\), or give a new "
                                                 r"or empty save_dir"):
        run(tmp_path, max_train_steps=4)
    assert snapshot(tmp_path / "ckpt") == before  # 0000-0002 not rewritten, last not moved back


def test_last_finding_nothing_beside_numbered_checkpoints_is_a_fresh_start_and_refused(tmp_path):
    run(tmp_path, max_train_steps=2, **{"checkpoint.save_last": False, "checkpoint.save_best": False})
    with pytest.raises(TrainerConfigError, match=r"resume_from 'last' finds no checkpoint there"):
        run(tmp_path, max_train_steps=4, **{"checkpoint.resume_from": "last"})


def test_resuming_an_older_step_beside_later_checkpoints_is_refused(tmp_path):
    run(tmp_path, max_train_steps=6)
    before = snapshot(tmp_path / "ckpt")
    older = str(tmp_path / "ckpt" / "0000-0002")
    with pytest.raises(TrainerConfigError, match=r"^checkpoint.resume_from: '.*0000-0002' is step 2 but .* holds later "
                                                 r"checkpoints \(0000-0004, 0001-0006\): .*--checkpoint.save_dir DIR"):
        run(tmp_path, max_train_steps=6, **{"checkpoint.resume_from": older})
    assert snapshot(tmp_path / "ckpt") == before and os.readlink(tmp_path / "ckpt" / "last") == "0001-0006"
    # the same branch into a new save_dir is fine
    assert len(run(tmp_path, max_train_steps=4, **{"checkpoint.resume_from": older,
                                                   "checkpoint.save_dir": str(tmp_path / "branch")})) == 2


def test_auto_starts_afresh_then_resumes(tmp_path):
    assert len(run(tmp_path, max_train_steps=2, **{"checkpoint.resume_from": "auto"})) == 2  # nothing there yet
    assert len(run(tmp_path, max_train_steps=4, **{"checkpoint.resume_from": "auto"})) == 2  # steps 3 and 4
    assert os.readlink(tmp_path / "ckpt" / "last") == "0000-0004"


def test_auto_takes_a_checkpoint_newer_than_last(tmp_path):
    # a crash between a checkpoint's commit and moving `last` to it
    run(tmp_path, max_train_steps=4)
    os.remove(tmp_path / "ckpt" / "last")
    os.symlink("0000-0002", tmp_path / "ckpt" / "last")
    args = TrainerArgs.from_dict(config(tmp_path, max_train_steps=4, **{"checkpoint.no_save": False,
                                                                       "checkpoint.resume_from": "auto"}))
    assert "0000-0004 is at step 4" in nothing_to_train(args)


@pytest.mark.parametrize("over, words", [
    ({"checkpoint.resume_from": "{tmp}/missing"}, "checkpoint.resume_from: '{tmp}/missing' does not exist; give a "
                                                  "checkpoint directory, 'last', 'best' or 'auto'"),
    ({"checkpoint.resume_from": "{tmp}"}, "is not a checkpoint directory (no manifest.json)"),
    ({"checkpoint.save_dir": "{tmp}/file"}, "checkpoint.save_dir: {tmp}/file is a file, not a directory"),
    ({"checkpoint.save_dir": "{tmp}/file/ckpt"}, "checkpoint.save_dir: {tmp}/file/ckpt cannot be created: "
                                                 "{tmp}/file is a file"),
    ({"gen_savedir": "{tmp}/file/gen"}, "gen_savedir: {tmp}/file/gen cannot be created"),
])
def test_bad_paths_are_one_error_naming_the_key(tmp_path, over, words):
    (tmp_path / "file").write_text("x")
    over = {k: v.format(tmp=tmp_path) for k, v in over.items()}
    args = TrainerArgs.from_dict(config(tmp_path, **{"checkpoint.no_save": False, **over}))
    with pytest.raises(TrainerConfigError) as e:
        check_paths(args)
    assert words.format(tmp=tmp_path) in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["file"]  # nothing written


def test_no_save_runs_beside_checkpoints(tmp_path):
    run(tmp_path, max_train_steps=2)
    before = snapshot(tmp_path / "ckpt")
    assert len(run(tmp_path, max_train_steps=2, **{"checkpoint.no_save": True})) == 2
    assert snapshot(tmp_path / "ckpt") == before


def test_nothing_to_train_names_the_checkpoint_and_the_end(tmp_path):
    run(tmp_path, max_train_steps=4)
    def note(**over):
        return nothing_to_train(TrainerArgs.from_dict(config(tmp_path, **{"checkpoint.no_save": False, **over})))
    assert note(max_train_steps=4, **{"checkpoint.resume_from": "auto"}) == (
        f"nothing to train: {tmp_path}/ckpt/0000-0004 is at step 4 and this run ends at max_train_steps 4; nothing "
        f"was written (raise --max_train_steps or --max_epochs to train on)")
    assert note(max_train_steps=6, **{"checkpoint.resume_from": "auto"}) is None
    assert note(max_train_steps=4) is None  # no resume: check_paths refuses it instead
