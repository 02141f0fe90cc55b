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
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import TYPE_CHECKING, List

import torch

from . import tracing_context
from ..errors import TraceError
from ..ops.registry import REGISTRY
from ..tree import iter_tensors as _tensors

if TYPE_CHECKING:
    from .recorder import Tracer

__all__ = ["is_user_function", "keep_functions", "settle_grad_modes"]

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


@contextlib.contextmanager
def keep_functions(tracer: "Tracer"):
    """For the block, every user Function defined so far records itself as one node when called
    (`keep_function` adds one defined later, from the ``apply`` hook)."""
    tracer._kept_classes = {}
    try:
        for cls in _user_functions():
            keep_function(tracer, cls)
        yield
    finally:
        for cls, own in tracer._kept_classes.items():
            if own is None:
                delattr(cls, "forward")
            else:
                cls.forward = own


def keep_function(tracer: "Tracer", cls) -> None:
    """Replace ``cls.forward`` (on the class itself, even when inherited) by one that records."""
    if cls in tracer._kept_classes:
        return
    tracer._kept_classes[cls] = cls.__dict__.get("forward")
    forward = cls.forward  # the plain function (forward is a staticmethod)
    with_ctx = not torch.autograd.function._is_setup_context_defined(cls.setup_context)

    def recording_forward(*fargs, **fkwargs):
        if tracing_context.current_tracer() is not tracer:  # the annotation check, a nested call
            return forward(*fargs, **fkwargs)
        return _record(tracer, cls, forward, fargs, fkwargs, with_ctx)

    cls.forward = staticmethod(recording_forward)


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


def _record(tracer: "Tracer", cls, forward, fargs, fkwargs, with_ctx):
    _check_importable(cls)
    args = fargs[1:] if with_ctx else fargs
    qualname = cls.__qualname__
    try:
        arg_refs, kwarg_refs = tracer._to_refs(tuple(args)), tracer._to_refs(dict(fkwargs))
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
    refs, result = tracer._wrap_outputs(real, qualname.rsplit(".", 1)[-1].lower())
    node = tracer._add_node(f"{cls.__module__}.{qualname}.apply", arg_refs, kwarg_refs, refs, annotation)
    if tracer._function_grad and tracer._function_grad[-1][0] is cls:  # called as cls.apply: mode known
        node.grad_enabled = tracer._function_grad[-1][1]
    else:  # through an apply bound before the trace: read from the outputs once torch has wrapped them
        tracer._kept_nodes.append((node, list(_tensors((args, fkwargs))), list(_tensors(result))))
    return result


def settle_grad_modes(tracer: "Tracer") -> None:
    """A kept Function's node runs with grad on unless its caller had grad off: inside forward torch
    turns grad off, so the caller's mode shows only afterwards, on the outputs (none requires grad
    although an input does). Either way the generated code gets the same gradients."""
    for node, ins, outs in tracer._kept_nodes:
        node.grad_enabled = any(t.requires_grad for t in outs) or not any(t.requires_grad for t in ins)

