"""The pieces of a parsed annotation (annotation.py has the grammar): `DimSpec`, `TensorSpec` and
`AnnotationError`, shared by parsing (annotation.py) and binding to shapes (bound_annotation.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

from nnscaler.ir.errors import NnScalerError

__all__ = ["AnnotationError", "DimSpec", "TensorSpec", "ELLIPSIS"]

ELLIPSIS = "..."


class AnnotationError(NnScalerError, ValueError):
    """A malformed annotation, or shapes / a partition that do not fit one.

    For syntax errors ``position`` is the offending character's offset in ``annotation`` and the
    message shows the annotation with a caret under that character.
    """

    def __init__(self, reason: str, annotation: Optional[str] = None,
                 position: Optional[int] = None):
        self.reason, self.annotation, self.position = reason, annotation, position
        msg = reason
        if annotation is not None:
            msg = f"{reason}\n    {annotation}"
            if position is not None:
                msg += "\n    " + " " * position + "^"
        super().__init__(msg)


@dataclass(frozen=True)
class DimSpec:
    """One dim of a tensor entry: ``name`` is an identifier, ``"1"`` or ``"..."``."""

    name: str  # for a group: "(" + member names + ")"
    marker: str = ""  # "", "+" or "^"
    ellipsis_name: str = ""  # the NAME of ``NAME...``
    pos: int = field(default=0, compare=False)
    members: Tuple["DimSpec", ...] = ()  # the members of a group ``(a b)``

    def __str__(self) -> str:
        if self.members:
            return "(" + " ".join(str(m) for m in self.members) + ")"
        return (self.ellipsis_name + ELLIPSIS) if self.name == ELLIPSIS else self.name + self.marker


@dataclass(frozen=True)
class TensorSpec:
    """One tensor entry; ``dims`` is None for ``?`` (an unannotated tensor)."""

    dims: Optional[Tuple[DimSpec, ...]]
    pos: int = field(default=0, compare=False)
    additive: bool = False

    def __str__(self) -> str:
        if self.dims is None:
            return "?"
        return ("+" if self.additive else "") + " ".join(str(d) for d in self.dims)


def _flat(dims):
    """The dims with groups replaced by their members."""
    for d in dims or ():
        yield from d.members or (d,)
