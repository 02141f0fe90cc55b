import pytest
import torch

from nnscaler.ir.layout import LayoutError, Partial, Replicate, Shard, TensorLayout


def test_reprs_and_equality():
    assert repr(Replicate()) == "R"
    assert repr(Partial()) == "V"
    assert repr(Shard(1)) == "D(1)"
    assert Shard(1) == Shard(1) and Shard(1) != Shard(0)
    assert Replicate() == Replicate() and Replicate() != Partial()
    assert len({Shard(0), Shard(0), Replicate(), Partial()}) == 3


def test_frozen():
    with pytest.raises(Exception):
        Shard(0).dim = 1


def test_shard_slices_cover_the_full_tensor():
    full = torch.arange(4 * 6).reshape(4, 6)
    pieces = []
    for i in range(3):
        lay = TensorLayout((4, 6), Shard(1), n=3, index=i)
        assert lay.slices() == ((0, 4), (2 * i, 2 * i + 2))
        assert lay.local_shape() == (4, 2)
        pieces.append(full[tuple(slice(a, b) for a, b in lay.slices())])
    assert torch.equal(torch.cat(pieces, dim=1), full)


def test_negative_dim_is_normalised():
    lay = TensorLayout((4, 6), Shard(-1), n=2, index=1)
    assert lay.placement == Shard(1)
    assert lay.slices() == ((0, 4), (3, 6))


@pytest.mark.parametrize("placement", [Replicate(), Partial()])
def test_replicate_and_partial_hold_the_full_shape(placement):
    lay = TensorLayout([4, 6], placement, n=4, index=3)
    assert lay.shape == (4, 6)
    assert lay.slices() == ((0, 4), (0, 6))
    assert lay.local_shape() == (4, 6)


def test_uneven_split_is_an_error():
    with pytest.raises(LayoutError, match="size 6 .* into 4"):
        TensorLayout((4, 6), Shard(1), n=4, index=0).slices()


@pytest.mark.parametrize("kwargs", [dict(n=0), dict(n=2, index=2), dict(n=2, index=-1)])
def test_bad_piece_count_or_index(kwargs):
    with pytest.raises(LayoutError):
        TensorLayout((4,), Replicate(), **kwargs)


def test_bad_shard_dim():
    with pytest.raises(LayoutError, match="out of range"):
        TensorLayout((4, 6), Shard(2), n=2)
    with pytest.raises(LayoutError):
        Shard("0")
    with pytest.raises(LayoutError):
        TensorLayout((4,), "R")


def test_scalar_tensor():
    lay = TensorLayout((), Partial(), n=2, index=1)
    assert lay.slices() == () and lay.local_shape() == ()
