"""verify(): sizes and SHA-256 of every file; the first bad file is named with the fix; load
refuses the same files and changes nothing."""
from __future__ import annotations

import pytest
import torch

from fake_modules import FakeParallel, trained
from nnscaler.ckpt import CheckpointError, load, save, verify

RANK0 = "rank-00000-of-00001.safetensors"


@pytest.fixture
def ckpt(tmp_path):
    pm, opt = trained()
    return save(tmp_path / "ck", pm, opt)


def test_a_good_checkpoint_verifies(ckpt):
    assert verify(ckpt)["kind"] == "sharded"


def test_truncated_file(ckpt):
    f = ckpt / RANK0
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=rf"{RANK0} has \d+ bytes, the manifest records \d+ \(truncated"):
        verify(ckpt)


def test_flipped_byte(ckpt):
    f = ckpt / RANK0
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{RANK0} does not match its SHA-256.*copy the file back"):
        verify(ckpt)


def test_missing_rank_file(ckpt):
    (ckpt / RANK0).unlink()
    with pytest.raises(CheckpointError, match=rf"{RANK0} is missing.*incomplete"):
        verify(ckpt)


def test_load_refuses_a_corrupt_file_and_changes_nothing(ckpt):
    f = ckpt / RANK0
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    pm = FakeParallel(seed=5)
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    with pytest.raises(CheckpointError, match="SHA-256"):
        load(ckpt, pm)
    assert all(torch.equal(before[k], v) for k, v in pm.state_dict().items())
