"""Generated code that no longer fits: a model of another width reused with reuse='match', and a
gen_savedir manifest with the wrong schema (issue 26)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from nnscaler import ComputeConfig, parallelize
from nnscaler.runtime.errors import ReuseError


class Emb(nn.Module):
    """Its width is a constructor argument: the input schema (token ids) does not show it."""

    def __init__(self, width=8):
        super().__init__()
        self.emb = nn.Embedding(10, width)
        self.fc = nn.Linear(width, 1)

    def forward(self, ids):
        return self.fc(self.emb(ids)).sum()


Emb.__module__ = __name__
IDS = {"ids": torch.randint(0, 10, (4, 3))}


def _pm(model, tmp_path, reuse="match"):
    return parallelize(model, IDS, "dp", ComputeConfig(1, 1, trace_strategy="cpu"), gen_savedir=tmp_path, reuse=reuse)


def _manifest(tmp_path):
    [path] = tmp_path.rglob("manifest.json")
    return path


def test_match_refuses_code_of_another_width_saying_it_is_stale(tmp_path):
    _pm(Emb(8), tmp_path)
    code = {p: p.read_bytes() for p in tmp_path.rglob("gencode*.py")}
    with pytest.raises(ReuseError) as info:  # before: PlanMismatchError "'emb.weight' in the given state has ..."
        _pm(Emb(16), tmp_path)
    msg = str(info.value)
    assert "reuse='match' refuses the code in" in msg and "it is stale" in msg
    assert "emb.weight: shape (10, 8) float32 then, shape (10, 16) float32 now" in msg
    assert "reuse='override'" in msg and "delete" in msg
    assert {p: p.read_bytes() for p in tmp_path.rglob("gencode*.py")} == code  # nothing lost


@pytest.mark.parametrize("reuse", ["moo", "override", "graph"])
def test_other_reuse_types_regenerate_for_the_new_width(tmp_path, reuse):
    _pm(Emb(8), tmp_path)
    torch.manual_seed(0)
    model = Emb(16)
    pm = _pm(model, tmp_path, reuse)
    ids = torch.randint(0, 10, (4, 3))
    torch.testing.assert_close(pm(ids), model(ids))
    assert json.loads(_manifest(tmp_path).read_text())["state_schema"]["emb.weight"] == [[10, 16], "float32"]


def test_same_width_still_reuses(tmp_path):
    _pm(Emb(8), tmp_path)
    stamp = _manifest(tmp_path).stat().st_mtime_ns
    _pm(Emb(8), tmp_path)
    assert _manifest(tmp_path).stat().st_mtime_ns == stamp


@pytest.mark.parametrize("edit, problem", [
    (lambda d: d.pop("compute_config"), "key(s) 'compute_config' missing"),
    (lambda d: d.update(files=[]), "'files' is a list"),
    (lambda d: d["files"].update({"gencode0.py": "abc"}), "files['gencode0.py'] is not"),
    (lambda d: d["compute_config"].pop("user_config"), "compute_config has no 'user_config'"),
])
def test_manifest_with_the_wrong_schema_names_the_file(tmp_path, edit, problem):
    _pm(Emb(8), tmp_path)
    path = _manifest(tmp_path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ReuseError) as info:  # before: KeyError: 'compute_config'
        _pm(Emb(8), tmp_path)
    msg = str(info.value)
    assert msg.startswith(f"the manifest {path} does not have the gen_savedir manifest's schema: {problem}")
    assert "reuse='override'" in msg
    _pm(Emb(8), tmp_path, reuse="override")  # the fix works
