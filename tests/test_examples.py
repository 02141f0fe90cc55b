"""The runnable examples run end to end (real processes, gloo) and train to the recorded losses.

Each example's per-step losses (as it prints them, 4 decimals) are compared with the golden file
tests/golden/example_losses.json, which also records the command line. After an intended change
of the numbers, regenerate the file and review its diff:

    python -m pytest tests/test_examples.py --update-golden

Tolerance: fp32 on gloo with a fixed seed is deterministic on one machine (repeated runs print
identical losses), so the only slack is one unit of the last printed digit, for a value that
sits on a rounding boundary: |loss - golden| <= 1e-4 at every step.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GOLDEN = Path(__file__).resolve().parent / "golden" / "example_losses.json"
STEPS = 5
TOL = 1e-4  # one unit of the 4th decimal the examples print
RUNS = {
    "train_gpt_dp": ["train_gpt_dp.py"],
    "train_gpt_pp_gpipe": ["train_gpt_pp.py", "--scheduler", "gpipe"],
}


def _run(name: str, tmp_path, attempts: int = 3):
    script, *args = RUNS[name]
    cmd = [sys.executable, str(EXAMPLES / script), "--steps", str(STEPS), "--gen-savedir", str(tmp_path / "gen"), *args]
    for _ in range(attempts):  # the examples pick a free port and bind it later: another process may take it
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        if proc.returncode == 0 or "address already in use" not in proc.stderr.lower():
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == STEPS and all(math.isfinite(x) and x > 0 for x in losses), proc.stdout
    return losses, proc.stdout


def _check_golden(name: str, losses, request):
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if request.config.getoption("--update-golden"):
        golden[name] = {"command": " ".join(["python", "examples/" + RUNS[name][0], "--steps", str(STEPS),
                                             *RUNS[name][1:]]),
                        "losses": losses}
        GOLDEN.write_text(json.dumps(golden, indent=2, sort_keys=True) + "\n")
        return
    assert name in golden, f"no golden losses for {name} in {GOLDEN}: run pytest {__file__} --update-golden"
    want = golden[name]["losses"]
    assert len(losses) == len(want), (losses, want)
    bad = [(step, got, exp) for step, (got, exp) in enumerate(zip(losses, want)) if abs(got - exp) > TOL]
    assert not bad, (f"{name}: losses differ from {GOLDEN.name} (step, got, golden): {bad}; if the change is "
                     f"intended, regenerate with --update-golden and review the diff")


@pytest.mark.multiprocess
def test_main_job_trains_with_data_parallelism(tmp_path, request):
    losses, _ = _run("train_gpt_dp", tmp_path)
    _check_golden("train_gpt_dp", losses, request)


@pytest.mark.multiprocess
def test_pipeline_example_prints_its_schedule_and_trains(tmp_path, request):
    losses, out = _run("train_gpt_pp_gpipe", tmp_path)
    timeline = [line for line in out.splitlines() if line.startswith("dev")]
    assert len(timeline) == 2  # one line per pipeline device
    assert timeline[0].split()[1:5] == ["F0", "F1", "F2", "F3"]  # gpipe: all forwards first
    _check_golden("train_gpt_pp_gpipe", losses, request)
