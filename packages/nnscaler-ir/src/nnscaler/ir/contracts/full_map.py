"""Where one rank's local tensor sits in its full (single-device) tensor.

Written by the generated code (``self.add_full_map(...)``), read by the runtime (weight loading,
the optimizer, ZeRO) and by the checkpoint package, which merges and reshards with it and never
imports the runtime.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Tuple

__all__ = ["FullMapEntry"]


@dataclass(frozen=True)
class FullMapEntry:
    """local_name: the tensor's attribute name in its ParallelModule; full_name: its name in the
    single-device model's state_dict; full_shape; slices: ``(start, stop)`` per dim of the full
    tensor that the local tensor holds; value_split ``(k, n)``: the local values are part k of n
    that sum to the full values (``(0, 1)``: the values themselves); replicas: how many devices of
    the unit hold this same piece."""

    local_name: str
    full_name: str
    full_shape: Tuple[int, ...]
    slices: Tuple[Tuple[int, int], ...]
    value_split: Tuple[int, int] = (0, 1)
    replicas: int = 1

    @property
    def local_shape(self) -> Tuple[int, ...]:
        return tuple(stop - start for start, stop in self.slices)

    @property
    def is_whole(self) -> bool:
        return self.local_shape == self.full_shape

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able dict (tuples become lists)."""
        return {"local_name": self.local_name, "full_name": self.full_name, "full_shape": list(self.full_shape),
                "slices": [list(s) for s in self.slices], "value_split": list(self.value_split),
                "replicas": self.replicas}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FullMapEntry":
        return cls(str(data["local_name"]), str(data["full_name"]), tuple(int(d) for d in data["full_shape"]),
                   tuple((int(a), int(b)) for a, b in data["slices"]),
                   tuple(int(v) for v in data.get("value_split", (0, 1))), int(data.get("replicas", 1)))
