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
