"""convert(): torch state_dict files (read with weights_only=True and a warning), safetensors files
and Hugging Face directories become merged checkpoints that load() reads."""
from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import load_file, save_model

from fake_modules import FakeParallel, Plain
from nnscaler.ckpt import CheckpointError, convert, load, merge, verify
from nnscaler.ckpt.convert import PickleReadWarning


def _same(pm, plain):
    return (torch.equal(pm.emb_weight, plain.emb.weight) and torch.equal(pm.fc_weight, plain.fc.weight)
            and torch.equal(pm.count, plain.count))


def test_torch_file_with_tied_weights(tmp_path):
    plain = Plain(seed=2)
    torch.save({"state_dict": plain.state_dict()}, tmp_path / "w.pt")
    with pytest.warns(PickleReadWarning, match=r"w.pt, a pickle, with torch.load\(weights_only=True\)"):
        convert(tmp_path / "w.pt", tmp_path / "m")
    weights = load_file(tmp_path / "m" / "model.safetensors")
    assert sorted(weights) == ["count", "emb.weight", "fc.bias", "fc.weight"]  # tied head.weight once
    pm = FakeParallel(seed=9)
    load(tmp_path / "m", pm)
    assert _same(pm, plain)


def test_hugging_face_directory(tmp_path):
    plain = Plain(seed=3)
    (tmp_path / "hf").mkdir()
    save_model(plain, str(tmp_path / "hf" / "model.safetensors"))
    convert(tmp_path / "hf", tmp_path / "m", max_shard_size="50B")
    assert verify(tmp_path / "m") and (tmp_path / "m" / "model.safetensors.index.json").is_file()
    pm = FakeParallel(seed=9)
    load(tmp_path / "m", pm)
    assert _same(pm, plain)
    convert(tmp_path / "m", tmp_path / "m2")  # a sharded HF layout converts too
    assert sorted(load_file(tmp_path / "m2" / "model.safetensors")) == ["count", "emb.weight", "fc.bias", "fc.weight"]


def test_a_pickle_with_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"w": Evil()}, f)
    with pytest.warns(PickleReadWarning), pytest.raises(CheckpointError, match=r"evil.pt cannot be read with "
                                                                               r"torch.load\(weights_only=True\)"):
        convert(tmp_path / "evil.pt", tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_bad_sources(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        convert(tmp_path / "none.pt", tmp_path / "m")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no model.safetensors"):
        convert(tmp_path / "empty", tmp_path / "m")
    torch.save({"w": torch.ones(2), "n": 3}, tmp_path / "mixed.pt")
    with pytest.warns(PickleReadWarning), pytest.raises(CheckpointError, match="not a state_dict of tensors"):
        convert(tmp_path / "mixed.pt", tmp_path / "m")


def test_merged_checkpoint_converts_back_to_itself(tmp_path):
    plain = Plain(seed=4)
    torch.save(plain.state_dict(), tmp_path / "w.bin")
    with pytest.warns(PickleReadWarning):
        convert(tmp_path / "w.bin", tmp_path / "m")
    merge(tmp_path / "m", tmp_path / "m2")  # merging a merged checkpoint is a copy
    a, b = load_file(tmp_path / "m" / "model.safetensors"), load_file(tmp_path / "m2" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
