"""Giving an existing object a mixin: ``obj.__class__`` becomes a subclass of (mixin, its class).

Used to give a user's optimizer nnscaler's methods (build_optimizer) and master weights
(precision.with_master_weights) while it stays an instance of its own class
(``isinstance(opt, torch.optim.Adam)``). One cache for every mixin, so an object mixed twice gets
one class per (mixin, class) pair.
"""
from __future__ import annotations

from typing import Dict, Tuple

__all__ = ["mix_into"]

_CLASSES: Dict[Tuple[type, type], type] = {}


def mix_into(obj: object, mixin: type, prefix: str) -> object:
    """Make `obj` an instance of a class deriving from `mixin` then its own class (named
    ``prefix + ClassName``, in the class's module); returns `obj`."""
    base = type(obj)
    key = (mixin, base)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{prefix}{base.__name__}", (mixin, base), {"__module__": base.__module__})
    obj.__class__ = _CLASSES[key]
    return obj
