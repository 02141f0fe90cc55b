"""The CLI on a broken installation: `nnscaler info` diagnoses it instead of crashing."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _info(pythonpath):
    env = dict(os.environ, COLUMNS="300", NO_COLOR="1", TERM="dumb",
               PYTHONPATH=os.pathsep.join([str(pythonpath), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run([sys.executable, "-m", "nnscaler.cli", "info"], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.multiprocess  # a fresh interpreter
@pytest.mark.parametrize("init, why", [
    ('raise OSError("libtorch_cpu.so: cannot open shared object file")',
     "OSError: libtorch_cpu.so: cannot open shared object file"),
    ("from . import _C  # the compiled part is missing\n", "ImportError: cannot import name '_C'"),
    ("__version__ = '2.13.0'  # imports, but has no torch.version / torch.distributed\n",
     "AttributeError: module 'torch' has no attribute 'version'"),
])
def test_info_reports_a_broken_torch(tmp_path, init, why):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(init)
    result = _info(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    out = " ".join(result.stdout.split())  # the table wraps long cells
    assert f"torch │ broken: {why}" in out
    assert "reinstall" in out and "nnscaler-cli" in out  # the rest of the report is still there
