"""`nnscaler ckpt merge | inspect | verify | convert`: the plug-in is found through its entry point
and each command exits 0 on success and 1, naming the file, on a bad checkpoint."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from fake_modules import Plain, trained
from nnscaler.ckpt import save, verify
from nnscaler.cli.main import app  # the `nnscaler` command itself: `ckpt` comes from the entry point
from nnscaler.cli.plugins import discover

RANK0 = "rank-00000-of-00001.safetensors"


def run(*args):
    return CliRunner().invoke(app, list(map(str, args)), env={"COLUMNS": "200", "NO_COLOR": "1"})


@pytest.fixture
def ckpt(tmp_path):
    pm, opt = trained()
    return save(tmp_path / "ck", pm, opt)


def test_the_plugin_is_registered():
    [plugin] = [p for p in discover() if p.name == "ckpt"]
    assert plugin.entry_point.value == "nnscaler.ckpt.cli:app" and not plugin.shadowed_by


def test_verify(ckpt):
    ok = run("ckpt", "verify", ckpt)
    assert ok.exit_code == 0 and "OK" in ok.output and "1 files verified" in ok.output
    f = ckpt / RANK0
    f.write_bytes(f.read_bytes()[:-1])
    bad = run("ckpt", "verify", ckpt)
    assert bad.exit_code == 1 and RANK0 in bad.output and "truncated" in bad.output


def test_inspect(ckpt):
    out = run("ckpt", "inspect", ckpt)
    assert out.exit_code == 0, out.output
    assert "sharded checkpoint" in out.output and "torch.optim.adam.Adam" in out.output
    assert "emb.weight" in out.output and "(6, 4)" in out.output and "4 tensors" in out.output
    missing = run("ckpt", "inspect", ckpt.parent / "nope")
    assert missing.exit_code == 1 and "does not exist" in missing.output


def test_merge(ckpt, tmp_path):
    out = run("ckpt", "merge", ckpt, tmp_path / "m", "--max-shard-size", "100B", "--model-only")
    assert out.exit_code == 0, out.output
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"emb.weight", "fc.weight", "fc.bias", "count"}
    assert verify(tmp_path / "m")["kind"] == "merged"
    again = run("ckpt", "merge", ckpt, tmp_path / "m")
    assert again.exit_code == 1 and "already exists" in again.output and "--overwrite" in again.output
    assert run("ckpt", "merge", ckpt, tmp_path / "m", "--overwrite").exit_code == 0
    bad = run("ckpt", "merge", ckpt, tmp_path / "m2", "--max-shard-size", "lots")
    assert bad.exit_code == 1 and "5GB" in bad.output


def test_convert_torch_file(tmp_path):
    plain = Plain(seed=2)
    torch.save(plain.state_dict(), tmp_path / "w.pt")
    with pytest.warns(UserWarning, match="weights_only=True"):
        out = run("ckpt", "convert", tmp_path / "w.pt", tmp_path / "m")
    assert out.exit_code == 0, out.output
    assert verify(tmp_path / "m")["kind"] == "merged"
