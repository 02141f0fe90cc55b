"""Sizes as 100KB / 64MB / 5GB / 1GiB / bytes."""
import pytest

from nnscaler.ckpt.sizes import parse_size


@pytest.mark.parametrize("text, value", [("100KB", 100_000), ("64MB", 64_000_000), ("5GB", 5 * 10**9),
                                         ("1GiB", 2**30), ("1.5 MB", 1_500_000), ("123", 123), (77, 77)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["lots", "5XB", "-1", 0, "0KB"])
def test_bad_sizes(text):
    with pytest.raises(ValueError, match="(100KB, 64MB, 5GB|positive)"):
        parse_size(text)
