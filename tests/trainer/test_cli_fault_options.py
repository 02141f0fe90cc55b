"""`nnscaler train --max_restarts N` (torch's elastic agent restarts the workers) and the launcher's
answer to SIGTERM, without starting workers: what reaches torch.distributed.run, the refusals."""
from __future__ import annotations

import importlib
import signal

import pytest

from test_cli import write

cli_main = importlib.import_module("nnscaler.trainer.cli.main")  # the module (the package exports main)


def _cfg(tmp_path, **over):
    return write(tmp_path, **{"compute_config.runtime_ngpus": 2, "checkpoint.no_save": False,
                              "checkpoint.resume_from": "auto", **over})


@pytest.fixture
def launches(monkeypatch):
    calls = []
    monkeypatch.setattr(cli_main, "_launch", lambda nproc, argv, max_restarts=0: calls.append(
        (nproc, argv, max_restarts)) or 0)
    monkeypatch.delenv("RANK", raising=False)
    return calls


def test_max_restarts_reaches_the_agent_and_implies_nproc(tmp_path, launches):
    cfg = _cfg(tmp_path)
    assert cli_main.main(["-f", cfg, "--max_restarts", "3"]) == 0
    assert cli_main.main(["-f", cfg, "--nproc", "2", "--max-restarts=1", "--seed", "1"]) == 0
    assert launches == [(2, ["-f", cfg], 3), (2, ["-f", cfg, "--seed", "1"], 1)]  # the flag is not forwarded


def test_torchrun_gets_max_restarts(monkeypatch):
    seen = []
    from torch.distributed import run as torchrun
    monkeypatch.setattr(torchrun, "main", lambda args: seen.append(args))
    assert cli_main._launch(2, ["-f", "cfg.yaml"], 3) == 0
    assert "--max-restarts=3" in seen[0] and seen[0][-3:] == ["nnscaler.trainer", "-f", "cfg.yaml"]


def test_sigterm_to_the_launcher_is_one_line_and_exit_143(monkeypatch, capsys):
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def stopped(args):
        raise SignalException("got SIGTERM", sigval=signal.SIGTERM)
    monkeypatch.setattr(torchrun, "main", stopped)
    assert cli_main._launch(2, ["-f", "cfg.yaml"]) == cli_main.PREEMPTED_EXIT == 143
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nnscaler: stopped by SIGTERM: forwarded to the workers, which stop after their step")


@pytest.mark.parametrize("argv,needle", [
    (["--max_restarts", "x"], "--max_restarts must be a non-negative integer, got 'x'"),
    (["--max_restarts", "-1"], "--max_restarts must be a non-negative integer, got '-1'"),
    (["--max_restarts"], "--max_restarts needs a value"),
])
def test_a_bad_max_restarts_is_one_line(tmp_path, launches, capsys, argv, needle):
    assert cli_main.main(["-f", _cfg(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and not launches


def test_max_restarts_needs_resume_from_auto(tmp_path, launches, capsys):
    assert cli_main.main(["-f", _cfg(tmp_path, **{"checkpoint.resume_from": ...}), "--max_restarts", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint.resume_from: is None but --max_restarts 2 restarts the workers")
    assert "--checkpoint.resume_from auto" in err and not launches
    assert cli_main.main(["-f", _cfg(tmp_path, **{"checkpoint.resume_from": ...}), "--max_restarts", "0"]) == 0


def test_max_restarts_under_torchrun_points_to_torchruns_flag(tmp_path, launches, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    assert cli_main.main(["-f", _cfg(tmp_path), "--max_restarts", "2"]) == 2
    assert "under torchrun give torchrun --max-restarts N instead" in capsys.readouterr().err and not launches
