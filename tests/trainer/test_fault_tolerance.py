"""docs/fault-tolerance.md on real `nnscaler train --nproc 2` runs: a rank SIGKILLed at several
points (one inside a checkpoint's commit) is restarted by ``--max_restarts`` and the run ends with
the weights and step count of an uninterrupted run, bitwise; SIGTERM to one worker, then to the
launcher, stops the run after the step in progress with a committed checkpoint and no traceback,
and the run resumed (``resume_from: auto``) in between holds an uninterrupted run's state at the
step it stopped, bitwise. One uninterrupted run (a checkpoint at every step, its ranks forked from the
session's fork server: cli_workers.py) is the reference."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from cli_workers import train_in_workers
from loop_helpers import config
from test_cli import env, nnscaler

pytestmark = pytest.mark.multiprocess


def _cfg(tmp: Path, name: str = "cfg.yaml", every: int = 2, **hook_args) -> str:
    data = config(tmp, hook={"type": "fault_hooks.Faults", "args": hook_args}, max_train_steps=6, **{
        "compute_config.runtime_ngpus": 2, "model.args.dropout": 0.1, "checkpoint.no_save": False,
        "checkpoint.every_n_train_steps": every, "checkpoint.resume_from": "auto"})
    path = tmp / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _final(save_dir: Path, step=None):
    """(step, {file: tensors}) of the newest checkpoint in save_dir, or of the one of `step`."""
    from nnscaler.trainer.checkpoints import checkpoint_state, list_checkpoints, resolve_resume
    path = resolve_resume("auto", str(save_dir)) if step is None else \
        next(p for _, s, p in list_checkpoints(str(save_dir)) if s == step)
    files = {f.name: load_file(str(f)) for f in sorted(Path(path).glob("*.safetensors"))}
    assert files, path
    return checkpoint_state(path)["step"], files


def _assert_same(got, ref, step=6):
    (got_step, files), (ref_step, ref_files) = got, ref
    assert got_step == ref_step == step
    assert sorted(files) == sorted(ref_files)
    for name, tensors in ref_files.items():
        assert sorted(files[name]) == sorted(tensors), name
        for key, value in tensors.items():
            assert files[name][key].equal(value), f"{name}: {key}"  # bitwise


def _steps_saved(save_dir: Path):
    return sorted(p.name for p in save_dir.iterdir() if p.name[0].isdigit())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    # the command's worker side in forked workers: what the tests check is the launcher's, in the runs they start
    tmp = tmp_path_factory.mktemp("uninterrupted")
    r = train_in_workers("-f", _cfg(tmp, every=1), "--nproc", "2", cwd=tmp)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return tmp / "ckpt"


def test_killed_ranks_are_restarted_and_the_run_ends_bitwise(tmp_path, reference):
    kills = [[0, "step_start", 1, 1],  # attempt 0: rank 1 before its first forward; nothing saved yet
             [1, "in_save", 4, 0],     # attempt 1: rank 0 inside the commit of step 4 (files written)
             [2, "step_end", 5, 1]]    # attempt 2: rank 1 after step 5's optimizer step
    r = nnscaler("train", "-f", _cfg(tmp_path, kills=kills), "--max_restarts", "3", cwd=tmp_path, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    resumed = [line.split(" at ")[1] for line in r.stdout.splitlines() if line.startswith("resumed from ")]
    assert resumed == ["epoch 0, step 2", "epoch 0, step 4"]  # attempt 1 started afresh
    assert _steps_saved(tmp_path / "ckpt") == ["0000-0002", "0000-0004", "0001-0006"]
    _assert_same(_final(tmp_path / "ckpt"), _final(reference))


def _launch(cfg: str, cwd: Path) -> subprocess.Popen:
    exe = os.path.join(os.path.dirname(sys.executable), "nnscaler")
    return subprocess.Popen([exe, "train", "-f", cfg, "--nproc", "2"], cwd=cwd, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_sigterm_stops_after_the_step_and_resume_is_bitwise(tmp_path, reference):
    # one worker only (rank 1, at the end of step 1): both ranks stop after step 1 and save it
    r = nnscaler("train", "-f", _cfg(tmp_path, "a.yaml", term_at=[1, 1]), "--nproc", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "preempted: stopped at step 1 (epoch 0)" in r.stdout
    assert _steps_saved(tmp_path / "ckpt") == ["0000-0001"]

    # resumed from step 1, the launcher gets SIGTERM while step 3 runs: it forwards it, the
    # workers save step 3 and exit
    marker = tmp_path / "marker"
    marker.mkdir()
    proc = _launch(_cfg(tmp_path, "b.yaml", marker=[3, str(marker)]), tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not (marker / "step").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (marker / "step").exists(), "step 3 never ran"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, out[-3000:] + err[-3000:]
    assert "Traceback" not in err and "preempted: stopped at step 3 (epoch 0)" in out
    assert "nnscaler: stopped by SIGTERM" in err
    assert _steps_saved(tmp_path / "ckpt") == ["0000-0001", "0000-0002", "0000-0003"]
    _assert_same(_final(tmp_path / "ckpt"), _final(reference, step=3), step=3)


def test_ctrl_c_stops_after_the_step_and_commits_it(tmp_path):
    # Ctrl-C: the terminal sends SIGINT to the command's whole process group; the workers (signalled
    # directly or by the agent) finish step 3, commit it and exit, with no KeyboardInterrupt traceback
    marker = tmp_path / "marker"
    marker.mkdir()
    exe = os.path.join(os.path.dirname(sys.executable), "nnscaler")
    proc = subprocess.Popen([exe, "train", "-f", _cfg(tmp_path, marker=[3, str(marker)]), "--nproc", "2"],
                            cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (marker / "step").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (marker / "step").exists(), "step 3 never ran"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, out[-3000:] + err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "preempted: stopped at step 3 (epoch 0) on SIGINT" in out, out[-3000:]
    assert "nnscaler: stopped by SIGINT" in err
    assert _steps_saved(tmp_path / "ckpt") == ["0000-0002", "0000-0003"]
