"""Install only what `nnscaler ckpt` needs: the wheels of nnscaler-ckpt, nnscaler-ir and
nnscaler-cli (built from this checkout) with their declared dependencies, into a fresh virtual
environment that sees none of this checkout's installs; then `nnscaler ckpt verify | inspect |
merge` on a checkpoint written by the full install."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from training import build, train

ROOT = Path(__file__).resolve().parents[2]
TORCH = os.environ.get("NNSCALER_TORCH_SPEC", "torch==2.13.0")  # the local CPU wheel (tools/install.sh)


def _run(cmd, **kw):
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kw)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ckpt_cli_from_a_fresh_environment_with_only_its_packages(tmp_path):
    import nnscaler.ckpt as ckpt
    pm, opt = build("one", 1, 1, str(tmp_path / "gen"))
    train(pm, opt, 0, 1)
    ckpt.save(tmp_path / "ck", pm, opt)

    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels,
          ROOT / "packages/nnscaler-ir", ROOT / "packages/nnscaler-ckpt", ROOT / "packages/nnscaler-cli"])
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)  # no system site-packages: none of this checkout's installs
    py = env_dir / "bin" / "python"
    lock = tmp_path / "constraints.txt"  # the repository's lock, as tools/install.sh applies it
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    lock.write_text("\n".join(l for l in lines if not l.lower().startswith(("torch==", "nvidia-", "triton=="))
                              or "NNSCALER_TORCH_SPEC" not in os.environ) + "\n")
    _run([py, "-m", "pip", "install", "-q", "-c", lock, TORCH, *sorted(wheels.glob("*.whl"))])
    listed = _run([py, "-m", "pip", "list", "--format=json"]).stdout
    ours = sorted(p["name"] for p in json.loads(listed) if p["name"].startswith("nnscaler"))
    assert ours == ["nnscaler-ckpt", "nnscaler-cli", "nnscaler-ir"]  # nothing else of ours came with them

    cli = env_dir / "bin" / "nnscaler"
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1")
    env.pop("PYTHONPATH", None)
    out = _run([cli, "ckpt", "verify", tmp_path / "ck"], env=env, cwd=tmp_path)
    assert "OK" in out.stdout
    out = _run([cli, "ckpt", "inspect", tmp_path / "ck"], env=env, cwd=tmp_path)
    assert "wte.weight" in out.stdout
    _run([cli, "ckpt", "merge", tmp_path / "ck", tmp_path / "merged"], env=env, cwd=tmp_path)
    merged = json.loads((tmp_path / "merged" / "manifest.json").read_text())
    assert "lm_head.weight" in merged["tensors"]
    _run([cli, "ckpt", "verify", tmp_path / "merged"], env=env, cwd=tmp_path)
    missing = subprocess.run([str(py), "-c", "import nnscaler.runtime"], capture_output=True, text=True, env=env,
                             cwd=tmp_path, timeout=120)
    assert missing.returncode != 0 and "nnscaler.runtime" in missing.stderr  # really not installed there
