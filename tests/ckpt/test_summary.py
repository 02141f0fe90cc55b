"""inspect(): what a checkpoint holds, from its manifest alone."""
from fake_modules import trained
from nnscaler.ckpt import inspect, merge, save


def test_inspect_sharded_and_merged(tmp_path):
    pm, opt = trained()
    save(tmp_path / "ck", pm, opt)
    info = inspect(tmp_path / "ck")
    assert info["kind"] == "sharded" and info["world_size"] == 1 and info["optimizer"] == "torch.optim.adam.Adam"
    assert info["optimizer_states"] == ["exp_avg", "exp_avg_sq", "step"]
    by_name = {t["name"]: t for t in info["tensors"]}
    assert sorted(by_name) == ["count", "emb.weight", "fc.bias", "fc.weight"]
    assert by_name["emb.weight"] == {"name": "emb.weight", "shape": [6, 4], "dtype": "float32", "pieces": 1,
                                     "bytes": 96, "numel": 24}
    assert info["parameters"] == 24 + 16 + 4 + 1 and info["model_bytes"] == 96 + 64 + 16 + 8
    merge(tmp_path / "ck", tmp_path / "m")
    merged = inspect(tmp_path / "m")
    assert merged["kind"] == "merged" and merged["parameters"] == info["parameters"]
    assert sorted(merged["files"]) == ["model.safetensors", "optimizer.safetensors", "rng.safetensors"]
    assert info["rng_ranks"] == [0] and merged["rng_ranks"] == [0]  # the ranks whose RNG states load restores
