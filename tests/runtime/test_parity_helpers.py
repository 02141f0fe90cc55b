"""The parity helpers themselves (tests/runtime/parity.py): they must not hide a difference."""
import pytest
import torch

from parity import assemble_full


def test_assemble_full_keeps_float64_exact():
    # a float64 value that float32 cannot hold: assembling must neither round it nor call two
    # exactly equal float64 replicas different
    value = torch.tensor([1.0 + 1e-12, 2.0], dtype=torch.float64)
    piece = ("w", (2,), ((0, 2),), value)
    full = assemble_full([(0, [piece]), (1, [piece])], "f64")
    assert full["w"].dtype == torch.float64 and torch.equal(full["w"], value)


def test_assemble_full_catches_disagreeing_replicas():
    a = ("w", (2,), ((0, 2),), torch.tensor([1.0, 2.0], dtype=torch.float64))
    b = ("w", (2,), ((0, 2),), torch.tensor([1.0, 2.0 + 1e-12], dtype=torch.float64))
    with pytest.raises(AssertionError, match="rank 1 disagrees"):
        assemble_full([(0, [a]), (1, [b])], "f64")
