"""Sizes written as ``100KB``, ``64MB``, ``5GB`` (powers of 1000, as Hugging Face's
``max_shard_size``), ``1GiB`` (powers of 1024) or a plain number of bytes."""
from __future__ import annotations

import re
from typing import Union

__all__ = ["parse_size"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(size: Union[int, str]) -> int:
    """Bytes of `size`; raises ValueError naming the accepted forms."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        return size
    m = _SIZE.match(str(size))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"size {size!r} is not understood: write it as 100KB, 64MB, 5GB, 1GiB or bytes")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return value
