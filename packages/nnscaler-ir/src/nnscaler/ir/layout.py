"""Placements of a sub-tensor relative to its full tensor.

A *full tensor* is the logical, single-device tensor; a *sub-tensor* is the piece of it that one
device holds. Its placement is one of three kinds, the same idea as ``torch.distributed.tensor``
(DTensor) placements:

=============  ==========  =====================================================================
nnscaler       DTensor     meaning
=============  ==========  =====================================================================
``R``          Replicate   every piece is the whole full tensor
``V``          Partial     value-split: every piece has the full shape, and the pieces *add up*
                           to the full value (DTensor's ``Partial("sum")``)
``D(dim)``     Shard(dim)  the full tensor is cut into ``n`` equal, contiguous pieces along
                           ``dim``; piece ``i`` is the ``i``-th one
=============  ==========  =====================================================================

Unlike DTensor, nnscaler requires an even split (the size along ``dim`` divisible by ``n``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple, Union

from .errors import NnScalerError

__all__ = ["Replicate", "Partial", "Shard", "Placement", "TensorLayout", "LayoutError"]


class LayoutError(NnScalerError, ValueError):
    """A layout that does not fit its full tensor (bad dim, uneven split, bad index)."""


@dataclass(frozen=True)
class Replicate:
    """``R``: the piece is the whole full tensor (DTensor ``Replicate()``)."""

    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """``V``: value-split; the pieces are partial sums adding up to the full tensor
    (DTensor ``Partial()``)."""

    def __repr__(self) -> str:
        return "V"


@dataclass(frozen=True)
class Shard:
    """``D(dim)``: split evenly along ``dim`` (DTensor ``Shard(dim)``)."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise LayoutError(f"Shard dim must be an int, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"D({self.dim})"


Placement = Union[Replicate, Partial, Shard]


@dataclass(frozen=True)
class TensorLayout:
    """One piece of a full tensor of shape ``shape``: piece ``index`` of ``n`` under ``placement``.

    For ``R`` the ``n`` pieces are replicas, for ``V`` partial sums, for ``D(dim)`` consecutive
    slices along ``dim`` (a negative ``dim`` counts from the end and is normalised).
    """

    shape: Tuple[int, ...]
    placement: Placement
    n: int = 1
    index: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not isinstance(self.placement, (Replicate, Partial, Shard)):
            raise LayoutError(f"placement must be R, V or D(dim), got {self.placement!r}")
        if self.n < 1:
            raise LayoutError(f"number of pieces must be >= 1, got {self.n}")
        if not 0 <= self.index < self.n:
            raise LayoutError(f"piece index {self.index} out of range for {self.n} pieces")
        if isinstance(self.placement, Shard):
            ndim = len(self.shape)
            dim = self.placement.dim
            if not -ndim <= dim < ndim:
                raise LayoutError(f"D({dim}) is out of range for a tensor of shape {self.shape}")
            if dim < 0:
                object.__setattr__(self, "placement", Shard(dim + ndim))

    def slices(self) -> Tuple[Tuple[int, int], ...]:
        """``(start, stop)`` per dim of the full tensor covered by this piece."""
        bounds = [(0, s) for s in self.shape]
        if isinstance(self.placement, Shard):
            dim = self.placement.dim
            size = self.shape[dim]
            if size % self.n:
                raise LayoutError(
                    f"cannot split dim {dim} of size {size} of a tensor of shape {self.shape} "
                    f"into {self.n} equal pieces"
                )
            step = size // self.n
            bounds[dim] = (self.index * step, (self.index + 1) * step)
        return tuple(bounds)

    def local_shape(self) -> Tuple[int, ...]:
        """The shape of this piece."""
        return tuple(stop - start for start, stop in self.slices())

    def __repr__(self) -> str:
        return f"TensorLayout({list(self.shape)}, {self.placement!r}, {self.index}/{self.n})"
