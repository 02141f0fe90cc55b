"""`nnscaler ckpt merge | inspect | verify` need only nnscaler-ckpt (+ nnscaler-ir) and
nnscaler-cli: run in a fresh interpreter where importing any other nnscaler part fails, on a
checkpoint written by the full install (a real parallelized module)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from training import build, train

_BLOCKER = """
import sys
BLOCKED = ("nnscaler.runtime", "nnscaler.policies", "nnscaler.codegen", "nnscaler.trainer", "nnscaler.lightning")
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(BLOCKED):
            raise ImportError(f"{name} is not installed here")
        return None
sys.meta_path.insert(0, Blocker())
from nnscaler.cli.main import app
app(sys.argv[1:], prog_name="nnscaler")
"""


def _cli(*args):
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1")
    return subprocess.run([sys.executable, "-c", _BLOCKER, *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.multiprocess
def test_ckpt_commands_without_the_engine(tmp_path):
    import nnscaler.ckpt as ckpt
    pm, opt = build("one", 1, 1, str(tmp_path / "gen"))
    train(pm, opt, 0, 1)
    ckpt.save(tmp_path / "ck", pm, opt)
    out = _cli("ckpt", "verify", tmp_path / "ck")
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr
    out = _cli("ckpt", "inspect", tmp_path / "ck")
    assert out.returncode == 0 and "wte.weight" in out.stdout and "GPT" in out.stdout, out.stderr
    out = _cli("ckpt", "merge", tmp_path / "ck", tmp_path / "m")
    assert out.returncode == 0, out.stderr
    assert "lm_head.weight" in json.loads((tmp_path / "m" / "manifest.json").read_text())["tensors"]
    assert _cli("ckpt", "verify", tmp_path / "m").returncode == 0
    blocked = subprocess.run([sys.executable, "-c", _BLOCKER.replace("from nnscaler.cli.main import app\n"
                                                                    "app(sys.argv[1:], prog_name=\"nnscaler\")",
                                                                    "import nnscaler.runtime")],
                             capture_output=True, text=True, timeout=60)
    assert blocked.returncode != 0 and "not installed here" in blocked.stderr  # the blocker works
