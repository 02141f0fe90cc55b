"""Assembling any region of a full tensor from stored pieces: uneven and empty shards, value-split
parts, ZeRO's flat ranges, per-parameter scalars; missing elements are an error."""
from __future__ import annotations

import pytest
import torch

from nnscaler.ckpt import CheckpointError
from nnscaler.ckpt.reshard import intersect, model_region, optimizer_region
from nnscaler.ckpt.safetensors_file import write_tensors
from nnscaler.ckpt.names import FORMAT, FORMAT_VERSION
from nnscaler.ckpt.records import Manifest
from nnscaler.ckpt.sources import Sources

FULL = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)


def _sources(tmp_path, pieces, optim=()):
    """pieces: (slices, value_split, tensor); optim: (state, slices, start, stop, kind, tensor)."""
    tensors, model, opt = [], [], []
    for i, (slices, split, value) in enumerate(pieces):
        tensors.append((f"m{i}", value))
        model.append({"file": "f.safetensors", "key": f"m{i}", "full_name": "w", "full_shape": [7, 5],
                      "slices": slices, "value_split": split, "dtype": "float32", "rank": i})
    for i, (state, slices, start, stop, kind, value) in enumerate(optim):
        tensors.append((f"o{i}", value))
        opt.append({"file": "f.safetensors", "key": f"o{i}", "full_name": "w", "state": state, "full_shape": [7, 5],
                    "slices": slices, "start": start, "stop": stop, "kind": kind, "dtype": str(value.dtype)[6:],
                    "rank": i})
    size, digest = write_tensors(tmp_path / "f.safetensors", tensors)
    manifest = {"files": {"f.safetensors": {"size": size, "sha256": digest}}, "model": model, "optimizer_state": opt}
    return Sources(tmp_path, Manifest.from_json({"format": FORMAT, "format_version": FORMAT_VERSION, "kind": "sharded",
                                                 "world_size": len(pieces), **manifest}))


def test_intersect():
    assert intersect(((0, 4), (0, 5)), ((2, 7), (1, 3))) == ((2, 4), (1, 3))
    assert intersect(((0, 2),), ((2, 4),)) is None
    assert intersect((), ()) == ()


def test_uneven_and_empty_shards(tmp_path):
    pieces = [([[0, 3], [0, 5]], [0, 1], FULL[0:3]), ([[3, 3], [0, 5]], [0, 1], FULL[3:3]),  # empty
              ([[3, 7], [0, 2]], [0, 1], FULL[3:7, 0:2]), ([[3, 7], [2, 5]], [0, 1], FULL[3:7, 2:5])]
    src = _sources(tmp_path, pieces)
    for region in (((0, 7), (0, 5)), ((2, 6), (1, 4)), ((5, 5), (0, 5)), ((6, 7), (4, 5))):
        got = model_region(src, ["w"], (7, 5), region, torch.float64)
        assert got.dtype == torch.float64
        assert torch.equal(got, FULL[region[0][0]:region[0][1], region[1][0]:region[1][1]].double()), region


def test_value_split_parts_are_summed(tmp_path):
    a = torch.randn(7, 5, dtype=torch.float64)
    parts = [([[0, 7], [0, 5]], [0, 2], a.float()), ([[0, 4], [0, 5]], [1, 2], (FULL[:4] - a[:4].float())),
             ([[4, 7], [0, 5]], [1, 2], (FULL[4:] - a[4:].float()))]
    got = model_region(_sources(tmp_path, parts), ["w"], (7, 5), ((0, 7), (0, 5)), torch.float32)
    assert torch.allclose(got, FULL, atol=1e-5)


def test_missing_elements_are_an_error(tmp_path):
    src = _sources(tmp_path, [([[0, 3], [0, 5]], [0, 1], FULL[0:3])])
    with pytest.raises(CheckpointError, match=r"no values for 20 elements of w\[\(2, 7\), \(0, 5\)\]"):
        model_region(src, ["w"], (7, 5), ((2, 7), (0, 5)), torch.float32)
    with pytest.raises(CheckpointError, match="has shape"):
        model_region(src, ["w"], (5, 7), ((0, 5), (0, 7)), torch.float32)
    with pytest.raises(CheckpointError, match="has no tensor 'v'"):
        model_region(src, ["v"], (7, 5), ((0, 7), (0, 5)), torch.float32)


def test_flat_zero_pieces_and_scalars(tmp_path):
    # two local tensors (rows 0-3 and 3-7), each cut into flat ranges as ZeRO does, one range stored twice
    top = FULL[0:3].reshape(-1)
    optim = [("exp_avg", [[0, 3], [0, 5]], 0, 8, "flat", top[0:8]),
             ("exp_avg", [[0, 3], [0, 5]], 8, 15, "flat", top[8:15]),
             ("exp_avg", [[0, 3], [0, 5]], 8, 15, "flat", top[8:15]),
             ("exp_avg", [[3, 7], [0, 5]], 0, 20, "local", FULL[3:7]),
             ("step", [[0, 3], [0, 5]], 0, 15, "scalar", torch.tensor(3.0))]
    src = _sources(tmp_path, [], optim)
    assert torch.equal(optimizer_region(src, "w", "exp_avg", ((0, 7), (0, 5))), FULL)
    assert torch.equal(optimizer_region(src, "w", "exp_avg", ((1, 5), (2, 4))), FULL[1:5, 2:4])
    assert float(optimizer_region(src, "w", "step", ((0, 7), (0, 5)))) == 3.0
    gap = _sources(tmp_path, [], optim[:1])
    with pytest.raises(CheckpointError, match="lacks part of the optimizer state exp_avg of w"):
        optimizer_region(gap, "w", "exp_avg", ((0, 3), (0, 5)))


def test_dim0_pieces_are_copied_as_bytes(tmp_path):
    from nnscaler.ckpt.reshard import model_segments
    rows = [([[0, 3], [0, 5]], [0, 1], FULL[0:3]), ([[3, 3], [0, 5]], [0, 1], FULL[3:3]),
            ([[3, 7], [0, 5]], [0, 1], FULL[3:7]), ([[0, 3], [0, 5]], [0, 1], FULL[0:3])]  # a replica too
    src = _sources(tmp_path, rows)
    segments = model_segments(src, ["w"], (7, 5), "float32")
    assert [length for _, _, length in segments] == [3 * 5 * 4, 4 * 5 * 4]
    data = b"".join(open(path, "rb").read()[off:off + n] for path, off, n in segments)
    assert data == FULL.numpy().tobytes()
    (tmp_path / "cols").mkdir()
    columns = _sources(tmp_path / "cols", [([[0, 7], [0, 2]], [0, 1], FULL[:, :2]), ([[0, 7], [2, 5]], [0, 1],
                                                                                     FULL[:, 2:])])
    assert model_segments(columns, ["w"], (7, 5), "float32") is None  # cut along dim 1: assembled instead
    assert model_segments(src, ["w"], (7, 5), "float64") is None  # another dtype: converted instead
