"""The shipped example (examples/trainer/gpt_char.yaml) trains, validates, checkpoints and resumes on
2 processes through the README's commands; the seed's own example config runs on 4 (nnscaler train's
worker side in forked workers)."""
from __future__ import annotations

import os
import re

import pytest

from cli_workers import train_in_workers
from test_cli import HERE, nnscaler

pytestmark = pytest.mark.multiprocess
ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLE = os.path.join(ROOT, "examples", "trainer", "gpt_char.yaml")


def losses(stdout):
    return [float(m.group(1)) for m in re.finditer(r"^epoch \d+ step \d+/\d+ \| loss ([0-9.]+)", stdout, re.M)]


def lrs(stdout):
    return [float(m.group(1)) for m in re.finditer(r"^epoch \d+ step \d+/\d+ \| .*\| lr ([0-9.e+-]+) \|", stdout, re.M)]


def files(root):
    return sorted((str(p), p.stat().st_mtime_ns) for p in root.rglob("*") if not p.is_symlink()) + \
        sorted((str(p), os.readlink(p)) for p in root.rglob("*") if p.is_symlink())


def test_gpt_char_example_trains_reruns_and_resumes(tmp_path):
    # the README's first command twice, then its follow-up (examples/trainer/gpt_char.yaml: resume_from auto,
    # T_max ${max_train_steps}), on a shorter run; then a resume from `last` (one training run serves both)
    first = ["train", "-f", EXAMPLE, "--nproc", "2", "--max_train_steps", "8", "--val_every_n_train_steps", "4",
             "--checkpoint.every_n_train_steps", "4", "--enable_progress_bar", "false"]
    r = nnscaler(*first, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    losses_first, lr_first = losses(r.stdout), lrs(r.stdout)
    assert len(losses_first) == 8 and losses_first[-1] < losses_first[0]
    assert r.stdout.count("val_loss") == 2
    run = tmp_path / "runs" / "gpt_char"
    ckpts = run / "checkpoints"
    assert os.readlink(ckpts / "last") == "0000-0008"
    assert list((run / "tensorboard" / "train").iterdir()) and list((run / "tensorboard" / "val").iterdir())
    before = files(tmp_path / "runs")
    r = nnscaler(*first, cwd=tmp_path)  # trains nothing, writes nothing, starts no worker
    assert r.returncode == 0 and r.stdout.startswith("nothing to train: ./runs/gpt_char/checkpoints/0000-0008 is at step 8"), r.stderr
    assert files(tmp_path / "runs") == before
    r = nnscaler(*first, "--checkpoint.resume_from!", cwd=tmp_path)  # without auto: refused before any worker
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "already holds checkpoints" in r.stderr, r.stderr
    assert files(tmp_path / "runs") == before
    r = nnscaler(*first, "--max_train_steps", "12", cwd=tmp_path)  # the follow-up: train on (the last value wins)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout and len(lrs(r.stdout)) == 4
    assert max(lrs(r.stdout)) <= min(lr_first)  # the cosine schedule does not climb back up
    assert os.readlink(ckpts / "last") == "0000-0012"
    r = nnscaler("train", "-f", EXAMPLE, "--nproc", "2", "--max_train_steps", "14", "--checkpoint.resume_from", "last",
                 "--enable_progress_bar", "false", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout and len(losses(r.stdout)) == 2


def test_seed_example_config_on_4_processes(tmp_path):
    # pas_policy as the seed has it: autodist (searching a plan over plan_ngpus=4)
    # the command's worker side on 4 forked workers (cli_workers.py): the config is what is tested here
    r = train_in_workers("-f", os.path.join(HERE, "seed_example.yaml"), "--nproc", "4",
                         "--compute_config.runtime_ngpus", "4", "--seed", "0", "--max_train_steps", "3",
                         "--gen_savedir", str(tmp_path / "gen"), "--checkpoint.save_dir", str(tmp_path / "ckpt"),
                         "--enable_progress_bar", "false", cwd=tmp_path, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(losses(r.stdout)) == 3
    assert sorted(n for n in os.listdir(tmp_path / "ckpt") if n[0].isdigit()) == ["0000-0001", "0000-0002", "0000-0003"]
