"""merge(): the Hugging Face layout with the single-device names, readable by plain safetensors,
loadable by load() into any plan; bad inputs refused."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, load_model

from fake_modules import FakeParallel, Plain, trained
from nnscaler.ckpt import CheckpointError, load, merge, save, verify


@pytest.fixture
def saved(tmp_path):
    pm, opt = trained()
    save(tmp_path / "ck", pm, opt, extra={"step": 2})
    return pm, opt, tmp_path / "ck"


def _plain_of(pm):
    plain = Plain()
    plain.load_state_dict({"emb.weight": pm.emb_weight, "head.weight": pm.emb_weight, "fc.weight": pm.fc_weight,
                           "fc.bias": pm.fc_bias, "count": pm.count})
    return plain


def test_single_file_layout(saved, tmp_path):
    pm, opt, ck = saved
    merge(ck, tmp_path / "merged")
    names = sorted(p.name for p in (tmp_path / "merged").iterdir())
    assert names == ["manifest.json", "model.safetensors", "optimizer.safetensors", "rng.safetensors"]
    weights = load_file(tmp_path / "merged" / "model.safetensors")
    plain = _plain_of(pm)
    expected = {k: v for k, v in plain.state_dict().items() if k != "head.weight"}  # tied: kept once
    assert set(weights) == set(expected)
    assert all(torch.equal(weights[k], v) for k, v in expected.items())
    fresh = Plain(seed=3)
    missing, unexpected = load_model(fresh, tmp_path / "merged" / "model.safetensors")
    assert not missing and not unexpected
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), plain.state_dict().values()))
    optim = load_file(tmp_path / "merged" / "optimizer.safetensors")
    state = opt.state_dict()["state"]
    assert torch.equal(optim["fc.weight.exp_avg"], state[1]["exp_avg"])
    assert torch.equal(optim["emb.weight.exp_avg_sq"], state[0]["exp_avg_sq"])
    assert float(optim["fc.bias.step"]) == 2.0
    assert verify(tmp_path / "merged")["kind"] == "merged"


def test_sharded_layout_with_index(saved, tmp_path):
    pm, _, ck = saved
    merge(ck, tmp_path / "merged", max_shard_size="20B", model_only=True)
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "merged").iterdir() if p.name.startswith("model-"))
    assert files == [f"model-0000{k}-of-00004.safetensors" for k in range(1, 5)]
    assert sorted(index["weight_map"]) == ["count", "emb.weight", "fc.bias", "fc.weight"]
    assert set(index["weight_map"].values()) == set(files)
    weights = {}
    for f in files:
        weights.update(load_file(tmp_path / "merged" / f))
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in weights.values())
    assert not (tmp_path / "merged" / "optimizer.safetensors").exists()
    pm2 = FakeParallel(seed=5)
    load(tmp_path / "merged", pm2)
    assert all(torch.equal(a, b) for a, b in zip(pm.state_dict().values(), pm2.state_dict().values()))


def test_merged_round_trip_with_optimizer_and_extra(saved, tmp_path):
    pm, opt, ck = saved
    merge(ck, tmp_path / "merged")
    pm2, opt2 = trained(seed=7, steps=1)
    assert load(tmp_path / "merged", pm2, opt2) == {"step": 2}
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[i][k], s2[i][k]) for i in s1 for k in s1[i])


def test_destination_exists(saved, tmp_path):
    _, _, ck = saved
    (tmp_path / "merged").mkdir()
    with pytest.raises(CheckpointError, match="merged already exists.*overwrite"):
        merge(ck, tmp_path / "merged")
    assert list((tmp_path / "merged").iterdir()) == []
    merge(ck, tmp_path / "merged", overwrite=True)
    assert verify(tmp_path / "merged")


def test_corrupt_source_is_refused_before_writing(saved, tmp_path):
    _, _, ck = saved
    f = ck / "rank-00000-of-00001.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank-00000-of-00001.safetensors does not match its SHA-256"):
        merge(ck, tmp_path / "merged")
    assert not (tmp_path / "merged").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_checkpoint_of_another_model_lists_the_differences(saved, tmp_path):
    _, _, ck = saved
    merge(ck, tmp_path / "merged")
    other = FakeParallel(dim=5, names={"fc.bias": "fc.offset"})
    with pytest.raises(CheckpointError, match=r"saved from another model \(missing fc.offset\[5\]; emb.weight: "
                                              r"\[6, 4\] in the checkpoint, \[6, 5\] in the model"):
        load(tmp_path / "merged", other)


def test_optimizer_type_mismatch(saved):
    _, _, ck = saved
    pm = FakeParallel()
    sgd = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError, match=r"state of a torch.optim.adam.Adam, this optimizer is a "
                                              r"torch.optim.sgd.SGD"):
        load(ck, pm, sgd)


def test_sgd_momentum_round_trip(tmp_path):
    pm, opt = trained(optimizer=lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9))
    save(tmp_path / "ck", pm, opt)
    merge(tmp_path / "ck", tmp_path / "merged")
    assert "fc.weight.momentum_buffer" in load_file(tmp_path / "merged" / "optimizer.safetensors")
    pm2 = FakeParallel(seed=1)
    opt2 = torch.optim.SGD(pm2.parameters(), lr=0.5, momentum=0.9)
    load(tmp_path / "merged", pm2, opt2)
    assert torch.equal(opt2.state_dict()["state"][1]["momentum_buffer"], opt.state_dict()["state"][1]["momentum_buffer"])
    assert opt2.param_groups[0]["lr"] == 0.1
