"""`nnscaler train` / `nnscaler compile` / `python -m nnscaler.trainer`: the plug-in, --print-config,
--nproc through torch.distributed.run, one-line errors."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from loop_helpers import config

HERE = os.path.dirname(os.path.abspath(__file__))


def env():
    paths = [HERE, *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), COLUMNS="200", NO_COLOR="1")


def write(tmp_path, **over):
    data = config(tmp_path, hook=..., **over)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def nnscaler(*args, cwd, timeout=240):
    exe = os.path.join(os.path.dirname(sys.executable), "nnscaler")
    return subprocess.run([exe, *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)


def test_print_config_is_only_yaml(tmp_path, capsys):
    from nnscaler.trainer.cli import main
    cfg = write(tmp_path)
    assert main(["-f", cfg, "--print-config", "--max_train_steps", "3", "--log.0.type",
                 "nnscaler.trainer.TensorBoardLogger"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["max_train_steps"] == 3 and data["log"] == [{"type": "nnscaler.trainer.TensorBoardLogger", "args": {}}]
    assert data["compute_config"]["use_end2end"] is True and data["gen_reuse"] == "auto"


def test_print_config_prints_the_values_training_uses(tmp_path, capsys):
    from nnscaler.trainer.cli import main
    cfg = write(tmp_path)
    assert main(["-f", cfg, "--print-config", "--optimizer.args.lr", "0.05", "--model.args.nlayers", "4",
                 "--model.args.name", "'7'"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["optimizer"]["args"]["lr"] == 0.05 and data["model"]["args"]["nlayers"] == 4  # not '0.05', '4'
    assert data["model"]["args"]["name"] == {"__value_type": "str", "value": "7"}  # the string '7', kept a string


def _no_launch(monkeypatch):
    import importlib
    cli_main = importlib.import_module("nnscaler.trainer.cli.main")  # the module (the package exports main)

    def launch(nproc, argv):
        raise AssertionError("a worker was started")
    monkeypatch.setattr(cli_main, "_launch", launch)


def _trained(tmp_path):
    from nnscaler.trainer.cli import main
    cfg = write(tmp_path, **{"checkpoint.no_save": False, "checkpoint.every_n_train_steps": 2, "max_train_steps": 4})
    assert main(["-f", cfg]) == 0  # one process, in this one
    return cfg


def test_the_launcher_refuses_before_any_worker_starts(tmp_path, capsys, monkeypatch):
    from nnscaler.trainer.cli import main
    cfg = _trained(tmp_path)
    _no_launch(monkeypatch)
    capsys.readouterr()
    config_before = (tmp_path / "ckpt" / "0000-0004" / "train_config.yaml").read_bytes()
    assert main(["-f", cfg, "--nproc", "1", "--checkpoint.resume_from", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == (f"error: checkpoint.resume_from: '{tmp_path}/missing' does not exist; give a "
                                       f"checkpoint directory, 'last', 'best' or 'auto'\n")
    assert main(["-f", cfg, "--nproc", "1"]) == 2  # a fresh start into a save_dir that holds checkpoints
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path}/ckpt already holds checkpoints" in err
    assert "--checkpoint.resume_from auto" in err and "new or empty save_dir" in err
    assert (tmp_path / "ckpt" / "0000-0004" / "train_config.yaml").read_bytes() == config_before


def test_a_finished_run_rerun_starts_no_worker_and_writes_nothing(tmp_path, capsys, monkeypatch):
    from nnscaler.trainer.cli import main
    cfg = _trained(tmp_path)
    _no_launch(monkeypatch)
    before = sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    capsys.readouterr()
    assert main(["-f", cfg, "--nproc", "1", "--checkpoint.resume_from", "auto"]) == 0
    assert capsys.readouterr().out.startswith(f"nothing to train: {tmp_path}/ckpt/0000-0004 is at step 4")
    assert sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before


def test_bad_config_is_one_line(tmp_path, capsys):
    from nnscaler.trainer.cli import main
    cfg = write(tmp_path)
    assert main(["-f", cfg, "--optimizer.clip_gnrm", "1"]) == 2
    assert capsys.readouterr().err.strip() == "error: optimizer: unknown key 'clip_gnrm'; did you mean 'clip_gnorm'?"
    assert main(["--max_epochs", "1"]) == 2
    assert "pass -f CONFIG.yaml" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_plugin_commands_and_module_entry(tmp_path):
    cfg = write(tmp_path)
    r = nnscaler("train", "-f", cfg, "--print-config", "--max_train_steps", "3", cwd=tmp_path)
    assert r.returncode == 0 and yaml.safe_load(r.stdout)["max_train_steps"] == 3, r.stderr
    r = nnscaler("train", "--help", cwd=tmp_path)
    assert r.returncode == 0 and "--print-config" in r.stdout and "--nproc" in r.stdout
    r = subprocess.run([sys.executable, "-m", "nnscaler.trainer", "-f", cfg, "--seed!"], cwd=tmp_path, env=env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.startswith("error: seed: set seed")


@pytest.mark.multiprocess
def test_train_nproc_2_through_torchrun(tmp_path):
    cfg = write(tmp_path, **{"compute_config.runtime_ngpus": 2, "checkpoint.no_save": True})
    r = nnscaler("train", "-f", cfg, "--nproc", "2", "--max_train_steps=4",
                 "--log.0.type", "nnscaler.trainer.TensorBoardLogger", "--log.0.args.root_dir", str(tmp_path / "tb"),
                 cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [l for l in r.stdout.splitlines() if l.startswith("epoch ")]
    assert len([l for l in lines if "| loss " in l]) == 4  # rank 0 only: one line per step
    assert "samples/s" in lines[0] and "ms/step" in lines[0] and "gnorm" in lines[0]
    assert (tmp_path / "tb" / "train_config.yaml").exists()


@pytest.mark.multiprocess
def test_a_failing_rank_stops_the_run(tmp_path):
    cfg = write(tmp_path, **{"compute_config.runtime_ngpus": 2, "dataset.type": "trainer_models.FailingDataset"})
    r = nnscaler("train", "-f", cfg, "--nproc", "2", cwd=tmp_path, timeout=180)
    assert r.returncode == 1
    assert "bad sample on rank 1" in r.stderr
    assert "training failed on a worker process" in r.stderr
