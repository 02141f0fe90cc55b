"""bench/guards.py still runs (``--smoke``: 2 gloo processes and 1): every variant holds
what it claims in the generated code (one guard in `guard`, generated branches in `branches`,
neither in the references) and every figure is reported. The figures are the benchmark's business."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_guards_bench_runs_and_reports(tmp_path):
    out = tmp_path / "guards.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "guards.py"), "--smoke", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"2", "1"}
    for world, r in data["results"].items():
        assert r["code"]["guard"]["guards"] == 1 and r["code"]["guard"]["branches"] == 0, (world, r["code"])
        assert r["code"]["branches"]["branches"] > 0 and r["code"]["branches"]["guards"] == 0, (world, r["code"])
        for ref in ("tensor_ops", "no_decision", "branches_ref"):
            assert r["code"][ref] == {"guards": 0, "branches": 0}, (world, ref, r["code"])
        assert all(v > 0 for v in r["ms_per_step"].values()), r["ms_per_step"]
        for key in ("guard_over_tensor_ops", "guard_over_no_decision", "branches_over_ref"):
            assert r[key]["of_medians"] > 0 and r[key]["paired"] > 0, (world, key)
        assert math.isfinite(r["guard_minus_no_decision_us"]) and r["check_us"]["check_agree_us"] > 0
    assert data["results"]["2"]["check_us"]["allreduce_us"] > 0
