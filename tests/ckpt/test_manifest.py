"""Reading manifest.json: every bad directory is refused with a message naming the file and the fix."""
from __future__ import annotations

import json

import pytest

from fake_modules import trained
from nnscaler.ckpt import CheckpointError, FORMAT_VERSION, save
from nnscaler.ckpt.manifest import read_manifest
from nnscaler.ir import NnScalerError


@pytest.fixture
def ckpt(tmp_path):
    pm, opt = trained()
    return save(tmp_path / "ck", pm, opt)


def test_reads_a_saved_manifest(ckpt):
    m = read_manifest(ckpt)
    assert m["kind"] == "sharded" and m["format_version"] == FORMAT_VERSION and m["world_size"] == 1
    assert list(m["files"]) == ["rank-00000-of-00001.safetensors"]
    assert m["optimizer"]["class"] == "torch.optim.adam.Adam"


def test_error_is_an_nnscaler_error():
    assert issubclass(CheckpointError, NnScalerError)


def test_missing_manifest(ckpt):
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest.json is missing.*not a complete checkpoint"):
        read_manifest(ckpt)


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2]"])
def test_corrupt_manifest(ckpt, text):
    (ckpt / "manifest.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"manifest.json (is corrupt|is not an nnscaler)"):
        read_manifest(ckpt)


def test_manifest_lacking_fields(ckpt):
    m = json.loads((ckpt / "manifest.json").read_text())
    del m["files"]
    (ckpt / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"manifest.json is corrupt \(lacks files\)"):
        read_manifest(ckpt)


def test_unknown_version(ckpt):
    m = json.loads((ckpt / "manifest.json").read_text())
    m["format_version"] = 99
    (ckpt / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"format version 99.*reads version 1: install"):
        read_manifest(ckpt)


def test_not_a_directory(tmp_path):
    f = tmp_path / "weights.pt"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"weights.pt is a file.*nnscaler ckpt convert"):
        read_manifest(f)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match=r"nope does not exist: pass"):
        read_manifest(tmp_path / "nope")
