"""A piece of one op: how a policy splits or replicates an op over plan devices.

A policy gives every op (``Node.pieces``) one `Piece` per plan device that runs it; codegen
reads them to choose each value's layout (``nnscaler.codegen.layouts``). An op replicated on two
devices has two pieces with all-R placements; an op partitioned along an annotated dimension into
n has n pieces with the placements its annotation gives (R / V / D(dim), ``nnscaler.ir.layout``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from ..layout import Partial, Replicate, Shard

__all__ = ["Piece"]


@dataclass
class Piece:
    """index, num: piece ``index`` of ``num``; inputs / outputs: the placements of the op's tensor
    inputs / outputs in this piece; dim: the annotated dimension split (None when replicated);
    device: the plan device that runs it (None until the policy assigns it)."""

    index: int
    num: int
    inputs: list  # placements of the op's tensor inputs
    outputs: list  # placements of the op's tensor outputs
    dim: Optional[str] = None
    device: Optional[int] = None

    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in list(self.inputs) + list(self.outputs))

    def describe(self) -> str:
        how = f"split {self.dim} {self.index}/{self.num}" if self.dim else f"replica {self.index}/{self.num}"
        return f"{how} on device {self.device}: in {self.inputs} out {self.outputs}"

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able dict; placements as ``"R"``, ``"V"`` or ``"D<dim>"``."""
        return {"index": self.index, "num": self.num, "inputs": [_placement_str(p) for p in self.inputs],
                "outputs": [_placement_str(p) for p in self.outputs], "dim": self.dim, "device": self.device}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Piece":
        return cls(int(data["index"]), int(data["num"]), [_placement(p) for p in data["inputs"]],
                   [_placement(p) for p in data["outputs"]], data.get("dim"),
                   None if data.get("device") is None else int(data["device"]))


def _placement_str(p) -> str:
    if isinstance(p, Shard):
        return f"D{p.dim}"
    if isinstance(p, Partial):
        return "V"
    if isinstance(p, Replicate):
        return "R"
    raise TypeError(f"not a placement: {p!r}")


def _placement(text: str):
    if text == "R":
        return Replicate()
    if text == "V":
        return Partial()
    if text.startswith("D"):
        return Shard(int(text[1:]))
    raise ValueError(f"not a placement: {text!r} (R, V or D<dim>)")

