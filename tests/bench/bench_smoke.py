"""`run_smoke(script, tmp_path)`: a bench script's ``--smoke`` run in a fresh interpreter, as the
bench smoke tests make it: its own cache and temporary directories, the results written to
`tmp_path` (bench/results/ untouched, checked), the run header present; returns the JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "bench", "results")


def run_smoke(script: str, tmp_path) -> dict:
    """Run ``bench/<script> --smoke --out <tmp>``; assert it passed, wrote a headed JSON and left
    bench/results/ as it was; return that JSON."""
    out = tmp_path / f"{os.path.splitext(script)[0]}.json"
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, NNSCALER_CACHE_DIR=str(tmp_path / "cache"), TMPDIR=str(tmp_path / "tmp"),
               PYTHONWARNINGS="ignore")
    before = sorted(os.listdir(RESULTS))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    data = json.loads(out.read_text())
    assert {"timestamp", "command", "machine"} <= set(data) and "--smoke" in data["command"]
    assert sorted(os.listdir(RESULTS)) == before
    return data
