"""The fast content check: a chunked CRC-32 recorded beside each file's SHA-256, computed while
the file is written; `load(verify=...)` levels ("fast" by default, "sha256" / True, "size" /
False); manifests without the CRC-32 still load (checked with the SHA-256)."""
from __future__ import annotations

import hashlib
import json
import zlib

import pytest
import torch

from fake_modules import FakeParallel, trained
from nnscaler.ckpt import CheckpointError, load, merge, save, verify
from nnscaler.ckpt import checksums
from nnscaler.ckpt.safetensors_file import SafetensorsWriter

RANK0 = "rank-00000-of-00001.safetensors"


@pytest.fixture
def ckpt(tmp_path):
    pm, opt = trained()
    return save(tmp_path / "ck", pm, opt, extra={"step": 2}), pm


def _flip(path, at=-3):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_manifest(ck, edit):
    manifest = json.loads((ck / "manifest.json").read_text())
    for record in manifest["files"].values():
        edit(record)
    (ck / "manifest.json").write_text(json.dumps(manifest))


def test_manifest_records_size_sha256_and_chunked_crc32(ckpt):
    ck, _ = ckpt
    record = json.loads((ck / "manifest.json").read_text())["files"][RANK0]
    data = (ck / RANK0).read_bytes()
    assert record["size"] == len(data) and record["sha256"] == hashlib.sha256(data).hexdigest()
    assert record["crc32"] == {"chunk": checksums.CRC_CHUNK, "values": [zlib.crc32(data)]}


def test_crc32_chunks_across_writes_and_copies(tmp_path, monkeypatch):
    monkeypatch.setattr(checksums, "CRC_CHUNK", 40)  # chunk boundaries inside tensors and copies
    src = torch.arange(64, dtype=torch.float32)
    w = SafetensorsWriter(tmp_path / "a.safetensors", [("x", "F32", (64,))])
    w.write("x", src)
    w.close()
    start = 8 + int.from_bytes((tmp_path / "a.safetensors").read_bytes()[:8], "little")
    w = SafetensorsWriter(tmp_path / "b.safetensors", [("y", "F32", (64,)), ("z", "F32", (3,))])
    w.copy("y", [(str(tmp_path / "a.safetensors"), start + 100, 156), (str(tmp_path / "a.safetensors"), start, 100)])
    w.write("z", torch.ones(3))
    w.close()
    data = (tmp_path / "b.safetensors").read_bytes()
    assert w.record["crc32"] == {"chunk": 40, "values": [zlib.crc32(data[i:i + 40]) for i in range(0, len(data), 40)]}
    assert w.record["sha256"] == hashlib.sha256(data).hexdigest() and w.record["size"] == len(data)
    assert checksums.crc32_chunks(data, 40, threads=2) == w.record["crc32"]["values"]


@pytest.mark.parametrize("level", ["fast", "sha256", True])
def test_flipped_byte_is_refused_at_every_checking_level(ckpt, level):
    ck, _ = ckpt
    _flip(ck / RANK0)
    pm = FakeParallel(seed=5)
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"{RANK0} does not match its SHA-256.*copy the file back"):
        load(ck, pm, verify=level)
    assert all(torch.equal(before[k], v) for k, v in pm.state_dict().items())


@pytest.mark.parametrize("level", ["size", False])
def test_size_level_checks_only_the_size(ckpt, level):
    ck, pm = ckpt
    _flip(ck / RANK0, at=-1)  # the last byte of the last tensor: a value changes, nothing is refused
    assert load(ck, FakeParallel(seed=5), verify=level) == {"step": 2}
    (ck / RANK0).write_bytes((ck / RANK0).read_bytes()[:-1])
    with pytest.raises(CheckpointError, match="truncated"):
        load(ck, FakeParallel(seed=5), verify=level)


def test_fast_level_checks_the_crc32_not_the_sha256(ckpt):
    ck, pm = ckpt

    def bad_crc(record):
        record["crc32"]["values"][0] ^= 1
    _edit_manifest(ck, bad_crc)
    with pytest.raises(CheckpointError, match=r"matches its SHA-256 but not its CRC-32.*manifest is corrupt"):
        load(ck, FakeParallel(seed=5))
    pm2 = FakeParallel(seed=5)
    assert load(ck, pm2, verify="sha256") == {"step": 2}
    assert all(torch.equal(a, b) for a, b in zip(pm.state_dict().values(), pm2.state_dict().values()))


def test_a_manifest_without_crc32_loads_and_is_checked_with_sha256(ckpt, tmp_path):
    ck, pm = ckpt
    _edit_manifest(ck, lambda record: record.pop("crc32"))
    pm2 = FakeParallel(seed=5)
    assert load(ck, pm2) == {"step": 2} and verify(ck)
    assert all(torch.equal(a, b) for a, b in zip(pm.state_dict().values(), pm2.state_dict().values()))
    merge(ck, tmp_path / "merged")
    _flip(ck / RANK0)
    with pytest.raises(CheckpointError, match=rf"{RANK0} does not match its SHA-256"):
        load(ck, FakeParallel(seed=5))


@pytest.mark.parametrize("level", ["fast", "sha256"])
def test_merge_refuses_a_corrupt_source_at_each_level(ckpt, tmp_path, level):
    ck, _ = ckpt
    _flip(ck / RANK0)
    with pytest.raises(CheckpointError, match=rf"{RANK0} does not match its SHA-256"):
        merge(ck, tmp_path / "merged", verify=level)
    assert not (tmp_path / "merged").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    merge(ck, tmp_path / "merged", verify="size")  # the size alone: merged as it is
    assert verify(tmp_path / "merged")["kind"] == "merged"


def test_unknown_level(ckpt):
    ck, _ = ckpt
    with pytest.raises(CheckpointError, match=r"verify='crc'.*'fast', 'sha256', 'size'"):
        load(ck, FakeParallel(), verify="crc")
