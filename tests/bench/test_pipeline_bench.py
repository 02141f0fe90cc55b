"""bench/pipeline.py still runs against the current executor (``--smoke``: 2 gloo
processes): every schedule reports a bubble in [0, 1), the analytic one for 1f1b, and activation
memory equal to the schedule's theory on every rank (1f1b at most gpipe's). Figures themselves
are the benchmark's business; this only keeps the script working."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pipeline_bench_runs_and_reports(tmp_path):
    out = tmp_path / "pipeline.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "pipeline.py"), "--smoke", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["schedules"]) == {"1f1b", "1f1b_plus", "gpipe", "1f1b_interleaved"}
    for name, s in data["schedules"].items():
        assert 0 <= s["bubble_measured_median"] < 1, name
        assert all(a["measured_over_theory"] == 1.0 for a in s["activations"]), (name, s["activations"])
    assert abs(data["schedules"]["1f1b"]["bubble_analytic"] - 1 / 5) < 1e-12  # (p-1)/(m+p-1), p=2, m=4
    gpipe = {a["rank"]: a["measured_bytes"] for a in data["schedules"]["gpipe"]["activations"]}
    assert all(a["measured_bytes"] <= gpipe[a["rank"]] for a in data["schedules"]["1f1b"]["activations"])
