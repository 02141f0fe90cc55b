"""The runnable examples run end to end (real processes, gloo) and print their losses."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(script: str, *args: str, tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--steps", "3",
                           "--gen-savedir", str(tmp_path / "gen"), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses), proc.stdout
    return losses, proc.stdout


@pytest.mark.multiprocess
def test_main_job_trains_with_data_parallelism(tmp_path):
    _run("train_gpt_dp.py", tmp_path=tmp_path)


@pytest.mark.multiprocess
def test_pipeline_example_prints_its_schedule_and_trains(tmp_path):
    _, out = _run("train_gpt_pp.py", "--scheduler", "gpipe", tmp_path=tmp_path)
    timeline = [line for line in out.splitlines() if line.startswith("dev")]
    assert len(timeline) == 2  # one line per pipeline device
    assert timeline[0].split()[1:5] == ["F0", "F1", "F2", "F3"]  # gpipe: all forwards first
