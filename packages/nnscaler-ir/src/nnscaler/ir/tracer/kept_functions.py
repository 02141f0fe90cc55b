"""A user's ``torch.autograd.Function`` stays whole in the generated program.

Tracing runs the forward for real, so without care the ops inside a Function's ``forward`` would
be recorded one by one and its ``backward`` lost: a straight-through estimator (``forward``
rounds, ``backward`` passes the gradient on) would train with the gradient of ``round`` (zero).
Instead, a call ``MyFunction.apply(...)`` of a Function defined outside torch and nnscaler is
recorded as one node whose target is ``package.module.MyFunction.apply``: the generated code
calls it, so its own forward and backward run.

The hook is the Function's ``forward``, replaced for the trace (`keep_functions`) on every such
class: torch's C++ ``apply`` looks ``forward`` up on the class at each call, so a call through an
``apply`` bound before the trace (``round_ste = RoundSTE.apply`` at module level) is seen too. The
forward's inputs and outputs are the objects the caller passes and gets back, so the node is
recorded there; its grad mode (the caller's, not forward's own grad-off) is the one the ``apply``
hook saw, or for a pre-bound ``apply`` read afterwards from the outputs (`settle_grad_modes`).

Such a node is unannotated (it runs replicated: its tensor inputs are made whole first) unless
the Function is registered with an annotation, ``register_op(MyFunction, "a b -> a b")`` (or as a
class decorator), which is checked numerically on the first traced call like any custom op's.
Functions of torch (``torch.utils.checkpoint``) and of nnscaler are traced through, as before.

Every Function, kept or traced through, also tells the tracer the grad mode it was called in
(``tracer.function_grad``): torch runs its forward with grad off (a reentrant
``torch.utils.checkpoint`` too), which is not the user's ``torch.no_grad()``.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Dict, List, Tuple

import torch

from . import tracing_context
from ..errors import TraceError
from ..ops.registry import REGISTRY
from ..tree import iter_tensors as _tensors
from .surface import TracerSurface

__all__ = ["is_user_function", "keep_functions"]

_TRACED_THROUGH = ("torch", "nnscaler", "functorch")


def is_user_function(cls) -> bool:
    """A Function subclass the generated code calls whole (not torch's or nnscaler's own)."""
    module = getattr(cls, "__module__", "") or ""
    return isinstance(cls, type) and issubclass(cls, torch.autograd.Function) \
        and module.split(".")[0] not in _TRACED_THROUGH


def _user_functions() -> List[type]:
    found, todo = [], list(torch.autograd.Function.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if is_user_function(cls) and cls not in found:
            found.append(cls)
    return found


class _Kept:
    """The Functions one trace keeps whole: the forwards it replaced, and the nodes whose grad mode
    is read from their outputs once the forward is done."""

    def __init__(self, tracer: TracerSurface):
        self.tracer = tracer
        self.forwards: Dict[type, Any] = {}  # class -> its own ``forward`` (None: inherited)
        self.unsettled: List[Tuple[Any, list, list]] = []  # (node, input tensors, output tensors)

    def keep(self, cls) -> None:
        """Replace ``cls.forward`` (on the class itself, even when inherited) by one that records."""
        if cls in self.forwards:
            return
        self.forwards[cls] = cls.__dict__.get("forward")
        forward = cls.forward  # the plain function (forward is a staticmethod)
        with_ctx = not torch.autograd.function._is_setup_context_defined(cls.setup_context)
        tracer = self.tracer

        def recording_forward(*fargs, **fkwargs):
            if tracing_context.current_tracer() is not tracer:  # the annotation check, a nested call
                return forward(*fargs, **fkwargs)
            return _record(self, cls, forward, fargs, fkwargs, with_ctx)

        cls.forward = staticmethod(recording_forward)

    def restore(self) -> None:
        for cls, own in self.forwards.items():
            if own is None:
                delattr(cls, "forward")
            else:
                cls.forward = own

    def settle_grad_modes(self) -> None:
        """A kept Function's node runs with grad on unless its caller had grad off: inside forward
        torch turns grad off, so the caller's mode shows only afterwards, on the outputs (none
        requires grad although an input does). Either way the generated code gets the same gradients."""
        for node, ins, outs in self.unsettled:
            node.grad_enabled = any(t.requires_grad for t in outs) or not any(t.requires_grad for t in ins)


@contextlib.contextmanager
def keep_functions(tracer: TracerSurface):
    """For the block, every user Function records itself as one node when called (one defined
    during the block too, from the ``apply`` hook), and every ``Function.apply`` pushes the grad
    mode it was called in on ``tracer.function_grad``. When the block ends normally, the nodes of
    calls through an ``apply`` bound before the trace get their grad mode."""
    kept = _Kept(tracer)
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if is_user_function(cls):  # a class defined after the trace began (its forward records too)
            kept.keep(cls)
        tracer.function_grad.append((cls, tracer.grad_enabled()))
        try:
            return original.__func__(cls, *args, **kwargs)
        finally:
            tracer.function_grad.pop()

    try:
        for cls in _user_functions():
            kept.keep(cls)
        torch.autograd.Function.apply = classmethod(apply)
        yield
        kept.settle_grad_modes()
    finally:
        torch.autograd.Function.apply = original
        kept.restore()


def _where(cls) -> str:
    try:
        return f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}"
    except (TypeError, OSError):
        return f"module {cls.__module__}"


def _check_importable(cls) -> None:
    module, qualname = cls.__module__, cls.__qualname__
    if module == "__main__" or "<locals>" in qualname:
        where = "in the script run as __main__" if module == "__main__" else "inside a function"
        raise TraceError(
            f"the autograd Function {qualname} ({_where(cls)}) has its own backward, so the generated code "
            f"calls it by name, but it is defined {where}: move the class to the top level of an "
            f"importable module (a .py file next to your script) and import it from there")


@functools.lru_cache(maxsize=None)
def _caller(cls):
    """``cls.apply`` as one stable callable (the annotation check caches its verdict per callable)."""
    def call(*args, **kwargs):
        return cls.apply(*args, **kwargs)
    call.__qualname__ = f"{cls.__qualname__}.apply"
    call.__signature__ = _forward_signature(cls)
    return call


def _forward_signature(cls):
    """``forward``'s parameters without ``ctx`` (for messages naming the argument)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    if params and params[0].name == "ctx":  # not with the setup_context style, whose forward has no ctx
        params = params[1:]
    return inspect.Signature(params)


def _record(kept: _Kept, cls, forward, fargs, fkwargs, with_ctx):
    tracer = kept.tracer
    _check_importable(cls)
    args = fargs[1:] if with_ctx else fargs
    qualname = cls.__qualname__
    try:
        arg_refs, kwarg_refs = tracer.to_refs(tuple(args)), tracer.to_refs(dict(fkwargs))
    except TypeError as e:
        raise TraceError(f"{qualname}.apply is called with an argument the generated code cannot rebuild "
                         f"({e}); pass tensors, numbers, strings, tuples or lists") from None
    with tracing_context.activate(None), torch.overrides._pop_mode_temporarily():
        real = forward(*fargs, **fkwargs)  # what the Function does inside is its own business
    inputs = {id(t) for t in _tensors((args, fkwargs))}
    if isinstance(real, torch.Tensor) and id(real) in inputs:  # torch would return a new view of it
        real = real.view_as(real)
    elif isinstance(real, tuple):
        real = tuple(r.view_as(r) if isinstance(r, torch.Tensor) and id(r) in inputs else r for r in real)
    annotation = REGISTRY.lookup(cls, args, fkwargs)
    if annotation is not None:
        with tracing_context.activate(None), torch.overrides._pop_mode_temporarily(), torch.enable_grad():
            REGISTRY.check_call(cls, _caller(cls), annotation, args, fkwargs, real)
    refs, result = tracer.wrap_outputs(real, qualname.rsplit(".", 1)[-1].lower())
    node = tracer.add_node(f"{cls.__module__}.{qualname}.apply", arg_refs, kwarg_refs, refs, annotation)
    if tracer.function_grad and tracer.function_grad[-1][0] is cls:  # called as cls.apply: mode known
        node.grad_enabled = tracer.function_grad[-1][1]
    else:  # through an apply bound before the trace: read from the outputs once torch has wrapped them
        kept.unsettled.append((node, list(_tensors((args, fkwargs))), list(_tensors(result))))
    return result
