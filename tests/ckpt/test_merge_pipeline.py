"""How merge moves the bytes: copied ranges are CRC'd once (the same CRC-32 serves the output's
record and the source's check, combined per chunk), tensors that must be assembled are read in
slabs a few ahead of the writing, and the writeback starts while it writes. The output is the
same bytes either way, and a corrupt source is refused with `verify`'s words wherever the bad
byte lies."""
from __future__ import annotations

import importlib
import json
import os
import threading
import zlib

import pytest
import torch

from fake_modules import trained
from nnscaler.ckpt import CheckpointError, merge, save, verify
from nnscaler.ckpt.checksums import crc32_chunks, crc32_combine
from nnscaler.ckpt.read_ahead import ReadAhead

merge_module = importlib.import_module("nnscaler.ckpt.merge")
RANK0 = "rank-00000-of-00001.safetensors"


@pytest.fixture
def ck(tmp_path):
    pm, opt = trained(dim=32, vocab=48)
    save(tmp_path / "ck", pm, opt, extra={"step": 2, "t": torch.arange(5)})
    return tmp_path / "ck"


def _bytes(d):
    return {n: (d / n).read_bytes() for n in sorted(os.listdir(d)) if n != "manifest.json"}


def _flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def _header(path):
    return json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])


def _offsets(path, key):
    start = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    a, b = _header(path)[key]["data_offsets"]
    return start + a, start + b


def test_crc32_combine_is_zlibs():
    data = os.urandom(70_000)
    for cut in (0, 1, 4096, 69_999, 70_000):
        assert crc32_combine(zlib.crc32(data[:cut]), zlib.crc32(data[cut:]), len(data) - cut) == zlib.crc32(data)


def test_the_check_reads_only_what_was_not_copied(ck, tmp_path, monkeypatch):
    check = importlib.import_module("nnscaler.ckpt.merge_check")
    read, crc_range = [], check._crc_range
    monkeypatch.setattr(check, "_crc_range", lambda view, lo, hi: read.append(hi - lo) or crc_range(view, lo, hi))
    merge(ck, tmp_path / "merged")
    copied = [k for k in _header(ck / RANK0) if k.startswith("model/") or k.startswith("optim/") and
              not k.endswith("/step")]  # Adam's step: per parameter, assembled
    assert len(copied) == 4 + 3 * 2
    assert sum(read) == (ck / RANK0).stat().st_size - sum(b - a for a, b in (_offsets(ck / RANK0, k) for k in copied))


def test_assembled_in_slabs_gives_the_same_bytes_as_copied(ck, tmp_path, monkeypatch):
    merge(ck, tmp_path / "copied")
    monkeypatch.setattr(merge_module, "model_segments", lambda *args: None)  # every tensor assembled in memory
    monkeypatch.setattr(importlib.import_module("nnscaler.ckpt.merge_writer"), "SLAB", 64)  # in slabs of a few rows
    merge(ck, tmp_path / "assembled")
    assert _bytes(tmp_path / "copied") == _bytes(tmp_path / "assembled")
    assert verify(tmp_path / "assembled").kind == "merged"


@pytest.mark.parametrize("where", ["copied", "gap"])
def test_a_corrupt_source_byte_is_found_wherever_it_lies(ck, tmp_path, where):
    start, stop = _offsets(ck / RANK0, "model/fc.weight" if where == "copied" else "extra/t")
    _flip(ck / RANK0, (start + stop) // 2)
    for level in ("fast", "sha256"):
        with pytest.raises(CheckpointError, match=rf"{RANK0} does not match its SHA-256"):
            merge(ck, tmp_path / "merged", verify=level)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_a_wrong_crc32_in_the_manifest_is_named_as_such(ck, tmp_path):
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"][RANK0]["crc32"]["values"][0] ^= 1
    (ck / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"matches its SHA-256 but not its CRC-32.*manifest is corrupt"):
        merge(ck, tmp_path / "merged")


def test_chunks_smaller_than_the_copied_windows_are_checked_from_the_file(ck, tmp_path):
    """Copied pieces that cross a chunk's boundary cannot be combined: that chunk is read again."""
    manifest = json.loads((ck / "manifest.json").read_text())
    data = (ck / RANK0).read_bytes()
    manifest["files"][RANK0]["crc32"] = {"chunk": 1000, "values": crc32_chunks(data, 1000)}
    manifest["files"][RANK0].pop("sha256")
    (ck / "manifest.json").write_text(json.dumps(manifest))
    merge(ck, tmp_path / "merged")
    start, stop = _offsets(ck / RANK0, "model/fc.weight")
    _flip(ck / RANK0, start + 1)
    with pytest.raises(CheckpointError, match=rf"{RANK0} does not match its CRC-32"):
        merge(ck, tmp_path / "again")


def test_read_ahead_keeps_order_raises_in_order_and_stops_early():
    made = []

    def produce():
        for i in range(100):
            made.append(i)
            yield i
    with ReadAhead(produce, depth=2) as ahead:
        items = iter(ahead)
        assert [next(items) for _ in range(3)] == [0, 1, 2]
    assert len(made) <= 7  # at most a few ahead, then stopped

    def broken():
        yield 1
        raise ValueError("bad slab")
    with ReadAhead(broken) as ahead:
        with pytest.raises(ValueError, match="bad slab"):
            list(ahead)
    assert not [t for t in threading.enumerate() if t.name == "nnscaler-ckpt-read-ahead"]
