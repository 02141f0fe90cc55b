"""Giving an existing object a mixin: ``obj.__class__`` becomes a subclass of (mixin, its class).

Used to give a user's optimizer nnscaler's methods (build_optimizer) and master weights
(precision.with_master_weights) while it stays an instance of its own class
(``isinstance(opt, torch.optim.Adam)``). One cache for every mixin, so an object mixed twice gets
one class per (mixin, class) pair.
"""
from __future__ import annotations

import weakref
from typing import Dict, Tuple

__all__ = ["mix_into", "rewrap_scheduler_step"]

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


def rewrap_scheduler_step(optimizer):
    """After `mix_into` changed an optimizer's class: an LR scheduler created before (it replaced
    ``optimizer.step`` on the instance by a wrapper of the *old* class's step, which would skip the
    mixin's step) now wraps the current class's step, still marking each call for the scheduler.
    Returns `optimizer`."""
    patched = optimizer.__dict__.get("step")
    if patched is None or not getattr(patched, "_wrapped_by_lr_sched", False):
        return optimizer
    ref = weakref.ref(optimizer)

    def step(*args, **kwargs):
        opt = ref()
        opt._opt_called = True
        return type(opt).step(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    optimizer.step = step
    return optimizer
