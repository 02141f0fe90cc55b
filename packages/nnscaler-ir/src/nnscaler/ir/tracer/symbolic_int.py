"""Ints that remember where they came from, for tracing with constant folding off.

With ``constant_folding=False`` a tensor's ``size()``/``shape`` yields `TracedInt`s: real ints (so
Python control flow on them runs as usual and decides the traced path) that also record the
arithmetic done on them (``bsz * num_heads``) as graph ops. When such an int reaches a torch
function the generated code computes it from the runtime shape instead of using the traced
constant. Leaving the int domain (``float(d)``, ``math.sqrt(d)``, comparisons) folds the value.
"""
from __future__ import annotations

import operator
from typing import Optional

from ..graph import Ref
from .surface import TracerSurface


class TracedInt(int):
    """An int produced during tracing, bound to a graph value of the active tracer."""

    def __new__(cls, value: int, tracer: TracerSurface, ref: Ref):
        obj = super().__new__(cls, value)
        obj._tracer = tracer
        obj._ref = ref
        return obj

    def ref_in(self, tracer: TracerSurface) -> Optional[Ref]:
        """The graph value of this int in `tracer`'s trace; None for an int of another trace."""
        return self._ref if self._tracer is tracer else None

    def _binop(self, op, other, reverse=False):
        if not isinstance(other, int) or isinstance(other, bool):
            plain = int(self)
            return op(other, plain) if reverse else op(plain, other)
        args = (other, self) if reverse else (self, other)
        return self._tracer.record_int_op(op, args)

    def __add__(self, o): return self._binop(operator.add, o)
    def __radd__(self, o): return self._binop(operator.add, o, True)
    def __sub__(self, o): return self._binop(operator.sub, o)
    def __rsub__(self, o): return self._binop(operator.sub, o, True)
    def __mul__(self, o): return self._binop(operator.mul, o)
    def __rmul__(self, o): return self._binop(operator.mul, o, True)
    def __floordiv__(self, o): return self._binop(operator.floordiv, o)
    def __rfloordiv__(self, o): return self._binop(operator.floordiv, o, True)
    def __mod__(self, o): return self._binop(operator.mod, o)
    def __rmod__(self, o): return self._binop(operator.mod, o, True)

    def __neg__(self):
        return self._tracer.record_int_op(operator.neg, (self,))

    def __index__(self):
        return int(self)

    def __reduce__(self):  # pickling/copying folds the value
        return (int, (int(self),))

    def __str__(self):  # str(d) / f"{d}" give the number, as for a plain int
        return str(int(self))

    def __repr__(self):
        return f"TracedInt({int(self)})"
