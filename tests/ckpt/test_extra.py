"""The caller's extra: JSON with tensors anywhere, refused when not JSON-able."""
import pytest
import torch

from nnscaler.ckpt import CheckpointError
from nnscaler.ckpt.extra import join_extra, split_extra


def test_round_trip():
    extra = {"step": 3, "sched": {"last_epoch": 2, "lrs": [0.1, 0.2]}, "pos": torch.tensor([4, 5]),
             "nested": [{"t": torch.ones(2)}], "none": None}
    data, tensors = split_extra(extra)
    assert sorted(tensors) == ["extra/nested/0/t", "extra/pos"]
    back = join_extra(data, tensors.__getitem__)
    assert back["step"] == 3 and back["sched"] == {"last_epoch": 2, "lrs": [0.1, 0.2]} and back["none"] is None
    assert torch.equal(back["pos"], torch.tensor([4, 5])) and torch.equal(back["nested"][0]["t"], torch.ones(2))


@pytest.mark.parametrize("extra, match", [([1], "must be a dict"), ({1: 2}, "key 1 .* is not a string"),
                                          ({"a": {"b": object()}}, "'a/b' is a object"),
                                          ({"x": float("inf")}, "'x' is inf")])
def test_refused(extra, match):
    with pytest.raises(CheckpointError, match=match):
        split_extra(extra)


def test_encode_extra_round_trips_what_json_cannot_hold():
    from nnscaler.ckpt import decode_extra, encode_extra
    value = {"t": (1, (2, 3)), 4: "int key", "inf": float("-inf"), "dtype": torch.bfloat16,
             "x": torch.arange(3), "l": [None, True]}
    data, tensors = split_extra({"v": encode_extra(value)})  # it is an extra ckpt.save accepts
    back = decode_extra(join_extra(data, tensors.__getitem__)["v"])
    assert back["t"] == (1, (2, 3)) and back[4] == "int key" and back["inf"] == float("-inf")
    assert back["dtype"] is torch.bfloat16 and torch.equal(back["x"], torch.arange(3)) and back["l"] == [None, True]
    with pytest.raises(CheckpointError, match=r"'/a/b' is a object"):
        encode_extra({"a": {"b": object()}})
    with pytest.raises(KeyError, match="mine /q"):
        encode_extra({"q": object()}, refuse=lambda path, v: KeyError(f"mine {path}"))


def test_decode_extra_reads_the_older_encodings():
    """Checkpoints written before the codec moved here: Lightning's tag, the Trainer's inline tensors."""
    from nnscaler.ckpt import decode_extra
    lightning = {"__nnscaler_lightning__": "tuple", "items": [1, {"__nnscaler_lightning__": "float", "value": "nan"}]}
    back = decode_extra(lightning)
    assert isinstance(back, tuple) and back[0] == 1 and back[1] != back[1]
    trainer = {"scale": 2.0, "w": {"__tensor__": [1.0, 2.0, 3.0, 4.0], "dtype": "float32", "shape": [2, 2]}}
    back = decode_extra(trainer)
    assert back["scale"] == 2.0 and torch.equal(back["w"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
