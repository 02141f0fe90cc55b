"""save() in one process: what is written, and every failure leaves the previous checkpoint and
no partial directory."""
from __future__ import annotations

import errno
import importlib
import json

import pytest
import torch
from safetensors.torch import load_file

from fake_modules import FakeParallel, trained
from nnscaler.ckpt import CheckpointError, load, save, verify

RANK0 = "rank-00000-of-00001.safetensors"
executor = importlib.import_module("nnscaler.ckpt.executor")  # the one writer of save and async_save


def test_files_and_manifest(tmp_path):
    pm, opt = trained()
    save(tmp_path / "ck", pm, opt, extra={"step": 7, "data": {"epoch": 1}, "ids": torch.arange(4)})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["manifest.json", RANK0]
    m = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert m["kind"] == "sharded" and m["plan"][0]["graph_fingerprint"] == "fake"
    assert m["tensors"]["emb.weight"] == {"shape": [6, 4], "dtype": "float32", "aliases": ["head.weight"]}
    assert "scratch" not in m["tensors"]  # non-persistent
    assert m["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert {r["state"] for r in m["optimizer_state"]} == {"step", "exp_avg", "exp_avg_sq"}
    tensors = load_file(tmp_path / "ck" / RANK0)  # plain safetensors, readable by anyone
    assert torch.equal(tensors["model/fc.weight"], pm.fc_weight.detach())
    assert torch.equal(tensors["extra/ids"], torch.arange(4))
    assert m["ranks"][0]["extra"] == {"step": 7, "data": {"epoch": 1}, "ids": {"__tensor__": "extra/ids"}}


def test_round_trip_restores_model_optimizer_rng_and_extra(tmp_path):
    pm, opt = trained()
    torch.manual_seed(123)
    save(tmp_path / "ck", pm, opt, extra={"step": 2, "ids": torch.arange(3)})
    expected = torch.rand(3)
    pm2, opt2 = trained(seed=9, steps=1)
    extra = load(tmp_path / "ck", pm2, opt2)
    assert extra["step"] == 2 and torch.equal(extra["ids"], torch.arange(3))
    assert torch.equal(torch.rand(3), expected)  # the RNG continues where it was saved
    for (k, a), b in zip(pm.state_dict().items(), pm2.state_dict().values()):
        assert torch.equal(a, b), k
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[i][k], s2[i][k]) for i in s1 for k in s1[i])
    assert opt2.param_groups[0]["lr"] == 0.1


def test_bad_kind_and_bad_extra_leave_nothing(tmp_path):
    pm, opt = trained()
    with pytest.raises(CheckpointError, match="kind must be 'sharded' or 'deduped'"):
        save(tmp_path / "ck", pm, kind="merged")
    with pytest.raises(CheckpointError, match=r"'cfg/fn' is a builtin_function_or_method, not a JSON value"):
        save(tmp_path / "ck", pm, extra={"cfg": {"fn": print}})
    with pytest.raises(CheckpointError, match=r"'lr' is nan"):
        save(tmp_path / "ck", pm, extra={"lr": float("nan")})
    assert list(tmp_path.iterdir()) == []


def test_existing_destination_is_refused(tmp_path):
    pm, opt = trained()
    save(tmp_path / "ck", pm, opt)
    before = (tmp_path / "ck" / RANK0).read_bytes()
    with pytest.raises(CheckpointError, match="already exists: choose a new path, or pass overwrite=True"):
        save(tmp_path / "ck", FakeParallel(seed=3))
    assert (tmp_path / "ck" / RANK0).read_bytes() == before
    save(tmp_path / "ck", FakeParallel(seed=3), overwrite=True)
    assert (tmp_path / "ck" / RANK0).read_bytes() != before and verify(tmp_path / "ck")


def test_disk_full_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    pm, opt = trained()
    save(tmp_path / "ck", pm, opt)
    before = (tmp_path / "ck" / RANK0).read_bytes()

    def full(path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(executor, "write_record", full)
    with pytest.raises(CheckpointError, match=r"could not write .*No space left.*previous checkpoint is intact"):
        save(tmp_path / "ck", FakeParallel(seed=4), overwrite=True)
    with pytest.raises(CheckpointError, match="No space left"):
        save(tmp_path / "ck2", FakeParallel(seed=4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no staging directory left
    assert (tmp_path / "ck" / RANK0).read_bytes() == before and verify(tmp_path / "ck")


def test_not_a_parallelized_module(tmp_path):
    with pytest.raises(CheckpointError, match="not a parallelized module.*nnscaler.parallelize"):
        save(tmp_path / "ck", torch.nn.Linear(2, 2))


def test_files_are_committed_and_listed_with_the_checkpoint(tmp_path):
    pm, opt = trained()
    save(tmp_path / "ck", pm, opt, files={"train_config.yaml": "seed: 0\n", "notes.bin": b"\x00\x01"})
    assert (tmp_path / "ck" / "train_config.yaml").read_text() == "seed: 0\n"
    m = verify(tmp_path / "ck")  # hashed like the rank files
    assert set(m["files"]) == {RANK0, "train_config.yaml", "notes.bin"}
    pm2, opt2 = trained(seed=9, steps=1)
    load(tmp_path / "ck", pm2, opt2)  # loading ignores them


@pytest.mark.parametrize("name", ["manifest.json", "a/b.yaml", ".hidden", "x.safetensors", ""])
def test_files_with_a_reserved_name_are_refused_before_anything_is_written(tmp_path, name):
    pm, opt = trained()
    with pytest.raises(CheckpointError, match="is not a usable file name"):
        save(tmp_path / "ck", pm, opt, files={name: b"x"})
    assert list(tmp_path.iterdir()) == []
