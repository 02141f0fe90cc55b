"""Giving an existing object a mixin: ``obj.__class__`` becomes a subclass of (mixin, its class).

Used to give a user's optimizer nnscaler's methods (build_optimizer), master weights
(precision.with_master_weights) and offloaded copies (offload.offload_optimizer) while it stays
an instance of its own class (``isinstance(opt, torch.optim.Adam)``). One cache for every mixin,
so an object mixed twice gets one class per (mixin, class) pair.

Why these doors, and what was checked (torch 2.13.0; the runtime declares torch>=2.4,<3):

- ``obj.__class__ = ...`` (plain Python): the optimizer must stay the user's object: an LR
  scheduler and Lightning's optimizer wrappers already hold it, Lightning's wrappers take its
  class as their base, and the user's ``isinstance`` checks must keep passing. A wrapper object
  would break all three; torch's public optimizer hooks (step pre/post hooks, state-dict hooks)
  cannot add the methods the mixins bring (``clip_gnorm``, ``sync_shard_grad``, ``zero_layout``,
  ``master_params``, ...) nor override ``zero_grad`` / ``add_param_group``. torch's own
  ``fully_shard`` (FSDP2) gives modules a new class the same way.
- torch's private scheduler flags (`rewrap_scheduler_step`): an `LRScheduler` created before the
  class changed replaced ``optimizer.step`` on the instance by a wrapper of the *old* class's
  step that marks ``_wrapped_by_lr_sched`` (on the wrapper) and sets ``_opt_called`` (on the
  optimizer) at each call; torch reads both in ``LRScheduler.step`` to warn about a scheduler
  stepped before its optimizer (torch/optim/lr_scheduler.py, ``patch_track_step_called``). The
  wrapper is replaced by one of the current class's step that keeps both marks, since torch has
  no public way to re-point it.
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
