"""The work a synchronous save leaves for after its commit (`after_commit`): a large rank file is
committed with its size and CRC-32, its SHA-256 is added to the manifest by a thread afterwards;
a checkpoint the thread never got to (a kill) is complete and checked with the CRC-32; the
checkpoint an overwrite replaced is deleted by the same thread."""
from __future__ import annotations

import hashlib
import importlib
import json
import os

import pytest
import torch

from fake_modules import FakeParallel, trained
from nnscaler.ckpt import CheckpointError, after_commit, load, merge, save, verify
from nnscaler.ckpt.records import FileRecord, RecordError

RANK0 = "rank-00000-of-00001.safetensors"
save_module = importlib.import_module("nnscaler.ckpt.save")


@pytest.fixture
def large(monkeypatch):
    """Every file counts as large: its SHA-256 and a replaced checkpoint's deletion come after the commit."""
    monkeypatch.setattr(save_module, "_INLINE", 0)


def _record(ck):
    return json.loads((ck / "manifest.json").read_text())["files"][RANK0]


def test_the_sha256_of_a_large_file_is_added_after_the_commit(tmp_path, large):
    pm, opt = trained()
    ck = save(tmp_path / "ck", pm, opt, extra={"step": 2})
    after_commit.wait()
    record = _record(ck)
    assert record["sha256"] == hashlib.sha256((ck / RANK0).read_bytes()).hexdigest() and "crc32" in record
    assert sorted(os.listdir(ck)) == ["manifest.json", RANK0]  # no temporary manifest left
    assert verify(ck).kind == "sharded" and load(ck, FakeParallel(seed=5), verify="sha256") == {"step": 2}


def test_a_checkpoint_committed_without_sha256_is_checked_with_its_crc32(tmp_path, large, monkeypatch):
    monkeypatch.setattr(after_commit, "start", lambda fd, replaced: os.close(fd))  # killed before the thread ran
    pm, opt = trained()
    ck = save(tmp_path / "ck", pm, opt, extra={"step": 2})
    record = _record(ck)
    assert "sha256" not in record and record["crc32"]["values"]
    verify(ck)
    pm2 = FakeParallel(seed=5)
    assert load(ck, pm2, verify="sha256") == {"step": 2}
    assert all(torch.equal(a, b) for a, b in zip(pm.state_dict().values(), pm2.state_dict().values()))
    data = bytearray((ck / RANK0).read_bytes())
    data[-3] ^= 0xFF
    (ck / RANK0).write_bytes(bytes(data))
    bad = rf"{RANK0} does not match its CRC-32 in the manifest \(corrupted\): copy the file back"
    with pytest.raises(CheckpointError, match=bad):
        verify(ck)
    for level in ("fast", "sha256"):
        with pytest.raises(CheckpointError, match=bad):
            load(ck, FakeParallel(seed=5), verify=level)
        with pytest.raises(CheckpointError, match=bad):
            merge(ck, tmp_path / "merged", verify=level)
    assert load(ck, FakeParallel(seed=5), verify="size") == {"step": 2}


def test_overwrite_deletes_the_replaced_checkpoint_after_the_commit(tmp_path, large):
    pm, opt = trained()
    save(tmp_path / "ck", pm, opt)
    save(tmp_path / "ck", pm, opt, overwrite=True)  # waits for the first save's thread
    after_commit.wait()
    assert os.listdir(tmp_path) == ["ck"] and "sha256" in _record(tmp_path / "ck")


def test_a_manifest_changed_meanwhile_is_kept(tmp_path):
    (tmp_path / RANK0).write_bytes(b"x" * 10)
    mine = json.dumps({"files": {RANK0: {"size": 10, "crc32": {"chunk": 64, "values": [1]}}}}).encode()
    (tmp_path / "manifest.json").write_bytes(b'{"replaced": true}')
    after_commit._run(after_commit.open_dir(tmp_path), mine, None)
    assert (tmp_path / "manifest.json").read_bytes() == b'{"replaced": true}'
    assert sorted(os.listdir(tmp_path)) == ["manifest.json", RANK0]


def test_a_file_record_needs_one_hash_at_least():
    assert FileRecord.from_json({"size": 1, "crc32": {"chunk": 8, "values": [3]}}).sha256 is None
    with pytest.raises(RecordError, match="lacks 'sha256'"):
        FileRecord.from_json({"size": 1})
    assert FileRecord(1, None, None).to_json() == {"size": 1}
