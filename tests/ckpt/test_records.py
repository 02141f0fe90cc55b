"""The manifest's typed records: JSON only at the disk boundary, written exactly as before (a
saved or merged manifest reads back into records that give the same JSON), and a corrupt record
refused on reading with the file, the field and the fix named."""
from __future__ import annotations

import json

import pytest
import torch

from fake_modules import FakeParallel, trained
from nnscaler.ckpt import CheckpointError, load, merge, save
from nnscaler.ckpt.manifest import read_manifest
from nnscaler.ckpt.records import Manifest, ModelPiece, OptimizerPiece


@pytest.fixture
def ckpt(tmp_path):
    pm, opt = trained()
    return save(tmp_path / "ck", pm, opt, extra={"step": 2, "t": torch.ones(2)}, files={"cfg.yaml": "a: 1\n"})


def _rewrite(ck, edit):
    data = json.loads((ck / "manifest.json").read_text())
    edit(data)
    (ck / "manifest.json").write_text(json.dumps(data))


def test_records_give_back_the_json_on_disk(ckpt, tmp_path):
    merge(ckpt, tmp_path / "merged")
    for ck in (ckpt, tmp_path / "merged"):
        text = (ck / "manifest.json").read_text()
        m = read_manifest(ck)
        assert json.dumps(m.to_json(), indent=1) + "\n" == text  # same keys, values and order
    m = read_manifest(ckpt)
    assert isinstance(m.model[0], ModelPiece) and isinstance(m.optimizer_state[0], OptimizerPiece)
    assert m.optimizer.cls == "torch.optim.adam.Adam" and m.ranks[0].extra["step"] == 2
    assert m["kind"] == m.kind == "sharded"  # the JSON field, as verify() returned it before


@pytest.mark.parametrize("edit, what", [
    (lambda m: m["model"][0].pop("full_name"), r"model\[0\] lacks 'full_name'"),
    (lambda m: m.update(world_size="2"), r"world_size is '2' \(expected int\)"),
    (lambda m: m["model"][1].update(slices=[[0]]), r"model\[1\]\.slices"),
    (lambda m: m["optimizer_state"][0].update(kind="dense"), r"optimizer_state\[0\]\.kind is 'dense'"),
    (lambda m: m["files"]["cfg.yaml"].update(size=None), r"files\['cfg.yaml'\]\.size is None"),
    (lambda m: m.update(ranks=[{"rng": {}}]), r"ranks\[0\] lacks 'file'"),
])
def test_a_corrupt_record_is_refused_naming_the_file_the_field_and_the_fix(ckpt, edit, what):
    _rewrite(ckpt, edit)
    fix = r": restore it from a copy, or use an earlier checkpoint"
    with pytest.raises(CheckpointError, match=rf"manifest.json is corrupt \({what}.*\){fix}"):
        read_manifest(ckpt)
    pm = FakeParallel(seed=5)
    before = pm.fc_weight.clone()
    with pytest.raises(CheckpointError, match=rf"manifest.json is corrupt \({what}"):
        load(ckpt, pm)
    assert torch.equal(pm.fc_weight, before)


def test_from_json_names_the_manifest_of_another_format():
    with pytest.raises(CheckpointError, match=r"the manifest is not an nnscaler checkpoint manifest"):
        Manifest.from_json({"format": "x"})
