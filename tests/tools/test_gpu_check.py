"""tools/gpu_check.sh on this machine (no CUDA): it starts, runs the packages from source with
generated entry points, skips the CUDA parts and says so (the benchmark's CPU smoke is turned off here:
bench/gpu.py --smoke has a test of its own),
exits 0, writes its log and JSON summary; a failing step makes it exit 1.

The script runs under ``python -S`` with PYTHONPATH set to a copy of this interpreter's
site-packages without any nnscaler distribution, .pth file or editable finder: what the GPU
image has (torch and friends, no nnscaler), so the from-source path is what is proved.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def _bare_site(dest: Path) -> Path:
    """Symlinks to this interpreter's site-packages entries, nnscaler's own left out."""
    site = Path(sysconfig.get_paths()["purelib"])
    dest.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("nnscaler", "_editable_impl_nnscaler", "__editable__")) or name.endswith(".pth"):
            continue
        (dest / entry.name).symlink_to(entry)
    return dest


@pytest.mark.multiprocess
def test_gpu_check_without_cuda_skips_the_cuda_parts_and_exits_0(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the script's CPU path is what this test checks")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "NNSCALER_TEST"))}
    env.update(OUT=str(out), GPU_CHECK_PYTHON=f"{sys.executable} -S", PYTHONPATH=str(_bare_site(tmp_path / "site")),
               TMPDIR=str(tmp_path), GPU_CHECK_TOTAL_S="300",
               GPU_CHECK_CPU_SMOKE="0")  # bench/gpu.py --smoke has its own test (tests/bench/test_gpu_bench.py)
    r = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    log = (out / "gpu_check.log").read_text()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:] + log[-4000:]
    assert "no CUDA device: skipped" in r.stdout
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["ok"] and not summary["cuda_available"] and summary["device"] is None
    assert summary["cuda_parts"] == "skipped: no CUDA device" and summary["torch"] == torch.__version__
    steps = summary["steps"]
    assert {n: steps[n]["status"] for n in ("env", "imports", "cli", "gpu_tests")} == dict.fromkeys(
        ("env", "imports", "cli", "gpu_tests"), "passed")
    # the full benchmark needs CUDA; its CPU smoke is turned off here, and the summary says so
    assert steps["bench"]["status"] == "skipped" and "GPU_CHECK_CPU_SMOKE=0" in steps["bench"].get("reason", ""), steps
    assert summary["bench_result"] is None
    # every module of the tier was collected (and skipped), and the gpu tests elsewhere too
    cases = ET.parse(out / "gpu_tests.xml").getroot().iter("testcase")
    modules = {c.get("classname").split(".")[2] for c in cases if c.get("classname", "").startswith("tests.gpu.")}
    assert modules == {p.stem for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
    assert "tests/ir/test_trace_device.py" in log
    counts = summary["pytest"]
    assert counts["skipped"] > 0 and counts["passed"] == counts["failed"] == counts["errors"] == 0
    # every package came from this checkout's sources, the distributions from the generated dist-info
    for pkg in ("ir", "runtime", "trainer", "ckpt", "policies", "lightning", "cli"):
        assert f"nnscaler.{pkg}: {ROOT}/packages/nnscaler-{pkg}/src/nnscaler/{pkg}/__init__.py" in log
    assert f"nnscaler: {ROOT}/src/nnscaler/__init__.py" in log
    assert f"nnscaler-trainer 0.1.0: {tmp_path}" in log and "nnscaler_trainer-0.1.0.dist-info" in log
    assert "Plug-in commands" in log or "plug-in commands" in log
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("gpu_check.")]  # its temp dir removed


@pytest.mark.multiprocess
def test_gpu_check_fails_when_a_step_fails(tmp_path):
    """A step that fails (here the CLI, through an interpreter that refuses `-m nnscaler.cli`) makes
    the summary not ok and the exit status 1, with the step's output on stdout; the other steps
    still run (pytest and the benchmark are refused too, to keep this cheap)."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/bash\n"
                    'case " $* " in *" -m nnscaler.cli "*|*" -m pytest "*|*" bench/gpu.py "*) echo "refused: $*" >&2; exit 3;; esac\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), GPU_CHECK_PYTHON=str(fake), TMPDIR=str(tmp_path))
    r = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    steps = summary["steps"]
    assert not summary["ok"]
    assert steps["cli"] == {"status": "failed", "seconds": steps["cli"]["seconds"], "reason": "exit status 3"}
    assert steps["gpu_tests"]["status"] == "failed" and steps["imports"]["status"] == "passed"
    assert "  | refused: -m nnscaler.cli --help" in r.stdout  # the failing step's output, shown
    assert "a step failed" in r.stdout
