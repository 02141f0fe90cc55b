"""The op registry: which dimension annotation an operator call has.

Keys are function objects as a ``__torch_function__`` handler receives them
(``torch.nn.functional.linear``, ``torch.matmul``, ``torch.Tensor.view``, ...). A value is an
annotation string (see `nnscaler.ir.ops.annotation`) or a callable ``(*args, **kwargs) -> str | None``
that computes the annotation of one call.

Convention: the tensor entries of an annotation correspond *only* to the tensor arguments of the
call, in their order of appearance in the flattened ``(args, kwargs)``: positional arguments left
to right (lists, tuples and dict values are entered), then keyword arguments in the order given.
Python numbers, None, shapes, dtypes and strings are not entries. The outputs are the tensors of
the result, flattened the same way. `tensor_leaves` implements this order.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Union

import torch

from nnscaler.ir.errors import TraceError
from nnscaler.ir.ops.annotation import AnnotationError, parse_annotation
from nnscaler.ir.ops import moe
from nnscaler.ir.ops.builtin_ops import register_builtins
from nnscaler.ir.ops.custom_op_check import check_custom_op
from nnscaler.ir.tracer.tracing_context import current_tracer
from nnscaler.ir.tree import tensor_leaves  # noqa: F401  (registry.tensor_leaves: used by callers)

__all__ = ["OpRegistry", "REGISTRY", "register_op", "tensor_leaves", "Annotation"]

Annotation = Union[str, Callable[..., Optional[str]]]




@dataclass(frozen=True)
class _Entry:
    annotation: Annotation
    name: str


def _derived_name(fn: Any) -> str:
    name = getattr(fn, "__name__", None) or repr(fn)
    if getattr(fn, "__objclass__", None) in (torch.Tensor, torch._C.TensorBase) or \
            getattr(torch.Tensor, name, None) is fn:
        return f"torch.Tensor.{name}"
    for prefix, ns in (("torch.nn.functional", torch.nn.functional), ("torch", torch)):
        if getattr(ns, name, None) is fn:
            return f"{prefix}.{name}"
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", name)
    return f"{module}.{qualname}" if module else qualname


class OpRegistry:
    """Maps operator functions to annotations (a string, or a callable computing one per call)."""

    def __init__(self) -> None:
        self._ops: Dict[Any, _Entry] = {}
        self._user: set = set()  # functions (and wrappers) annotated by register_op: checked when traced

    def register(self, fn: Any, annotation: Annotation, name: Optional[str] = None) -> None:
        """Register (or replace) ``fn``'s annotation; a string is validated at once."""
        if isinstance(annotation, str):
            parse_annotation(annotation)
        elif not callable(annotation):
            raise TypeError(f"an annotation must be a string or a callable, got {annotation!r}")
        self._ops[fn] = _Entry(annotation, name or _derived_name(fn))

    def lookup(self, fn: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Optional[str]:
        """The annotation string of the call ``fn(*args, **kwargs)``; None means unannotated (the op
        runs replicated), also when a callable annotation raises or returns None."""
        try:
            entry = self._ops.get(fn)
        except TypeError:  # unhashable
            return None
        if entry is None:
            return None
        anno = entry.annotation
        if isinstance(anno, str):
            return anno
        try:
            text = anno(*args, **(kwargs or {}))
        except Exception as e:
            if fn in self._user:  # a user's annotation function that fails is not a silent replication
                raise TraceError(f"the annotation function {getattr(anno, '__qualname__', anno)!r} of custom op "
                                 f"{entry.name} raised {type(e).__name__}: {e}; it must return the annotation "
                                 f"string of the call (or None to run the op replicated)") from e
            return None
        if text is None:
            return None
        try:
            parse_annotation(text)
        except AnnotationError as e:
            raise AnnotationError(f"the annotation computed for {entry.name} is invalid: "
                                  f"{e.reason}", e.annotation, e.position) from None
        return text

    def check_call(self, wrapper: Any, fn: Any, annotation: Optional[str], args: tuple, kwargs: dict,
                   result: Any) -> None:
        """Check a custom op's annotation on a traced call (`nnscaler.ir.ops.custom_op_check`): raises
        TraceError when it does not fit the shapes or a split it allows changes the numbers."""
        try:
            if fn not in self._user and wrapper not in self._user:
                return  # a built-in annotation: checked by the tests (tests/ir/test_registry.py)
        except TypeError:  # unhashable
            return
        check_custom_op(self.name_of(wrapper), fn, annotation, args, kwargs, result)

    def name_of(self, fn: Any) -> str:
        """A dotted name under which ``fn`` can be found: the registered one, else a derived one."""
        entry = self._ops.get(fn)
        return entry.name if entry is not None else _derived_name(fn)

    def annotation_of(self, fn: Any) -> Optional[Annotation]:
        """The registered annotation (string or callable) of ``fn``, or None."""
        entry = self._ops.get(fn)
        return entry.annotation if entry is not None else None

    def __contains__(self, fn: Any) -> bool:
        try:
            return fn in self._ops
        except TypeError:
            return False

    def __len__(self) -> int:
        return len(self._ops)

    def functions(self) -> List[Any]:
        """All registered functions."""
        return list(self._ops)


REGISTRY = OpRegistry()


def register_op(fn: Optional[Callable] = None, annotation: Optional[Annotation] = None, *,
                name: Optional[str] = None, override: bool = False):
    """Register a custom op with its annotation; usable as ``register_op(fn, "a b -> a b")``,
    ``@register_op("a b -> a b")`` or ``@register_op(annotation=...)``.

    Returns a wrapper that, while a trace is running, asks the tracer to record one node
    (``tracer.record_custom_op(fn, args, kwargs)``) and otherwise calls ``fn``. Both the wrapper
    and ``fn`` are registered in `REGISTRY`; ``wrapper.__nnscaler_op__`` is ``fn`` and
    ``fn.__nnscaler_wrapper__`` the wrapper.

    A function or a name that is already registered (a built-in op, or an earlier register_op) is
    refused with a ValueError unless ``override=True``; registering the same function again with
    the same annotation is allowed and returns the existing wrapper. The annotation is checked on
    the first traced call with given shapes (see `nnscaler.ir.ops.custom_op_check`).
    """
    if fn is None or isinstance(fn, str):
        if isinstance(fn, str):
            if annotation is not None:
                raise TypeError("register_op(annotation_string) takes no second annotation")
            annotation = fn
        if annotation is None:
            raise TypeError("register_op needs an annotation, e.g. @register_op('a b -> a b')")
        _validate(annotation, "register_op")
        return lambda f: register_op(f, annotation, name=name, override=override)
    if not callable(fn):
        raise TypeError(f"register_op: {fn!r} is not callable")
    fn = getattr(fn, "__nnscaler_op__", fn)
    label = f"register_op({getattr(fn, '__qualname__', fn)!r})"
    if annotation is None:
        raise TypeError(f"{label} needs an annotation, e.g. register_op(fn, 'a b -> a b')")
    _validate(annotation, label)
    function_class = _autograd_function_class(fn)
    if function_class is not None:  # kept whole by the tracer (nnscaler.ir.tracer.kept_functions): no wrapper
        old = REGISTRY._ops.get(function_class)
        if old is not None and old.annotation != annotation and not override:
            raise ValueError(f"{label}: {REGISTRY.name_of(function_class)} is already registered with the "
                             f"annotation {_show(old.annotation)}; pass override=True to replace it")
        REGISTRY.register(function_class, annotation, name)
        REGISTRY._user.add(function_class)
        return fn
    existing = _existing_wrapper(fn, annotation, name, override, label)
    if existing is not None:
        return existing

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        tracer = current_tracer()
        if tracer is not None:
            return tracer.record_custom_op(fn, args, kwargs)
        return fn(*args, **kwargs)

    wrapper.__nnscaler_op__ = fn
    try:  # lets a tracer holding ``fn`` find the wrapper
        fn.__nnscaler_wrapper__ = wrapper
    except (AttributeError, TypeError):
        pass
    REGISTRY.register(fn, annotation, name)
    REGISTRY.register(wrapper, annotation, name or REGISTRY.name_of(fn))
    REGISTRY._user.update((fn, wrapper))
    return wrapper


def _autograd_function_class(fn):
    """The autograd Function class of ``fn`` (the class, or its ``apply``), else None."""
    owner = getattr(fn, "__self__", None) if getattr(fn, "__name__", "") == "apply" else fn
    if isinstance(owner, type) and issubclass(owner, torch.autograd.Function):
        return owner
    return None


def _existing_wrapper(fn, annotation, name, override, label):
    """The wrapper of an identical earlier registration of ``fn``; raises for a conflicting one
    (the function, or the name, registered before with another annotation or for another
    function) unless ``override``."""
    target = name or _derived_name(fn)
    old = REGISTRY._ops.get(fn)
    same_name = [f for f, e in REGISTRY._ops.items()
                 if e.name == target and f is not fn and getattr(f, "__nnscaler_op__", None) is not fn]
    if old is not None and not same_name and old.annotation == annotation and old.name == target \
            and getattr(fn, "__nnscaler_wrapper__", None) is not None:
        return fn.__nnscaler_wrapper__
    if override or (old is None and not same_name):
        return None
    if old is not None:
        what = f"{REGISTRY.name_of(fn)} is already registered with the annotation {_show(old.annotation)}"
    else:
        what = f"the name {target!r} is already registered for another function ({_show(REGISTRY._ops[same_name[0]].annotation)})"
    raise ValueError(f"{label}: {what}; pass override=True to replace it "
                     f"(register_op(fn, annotation, override=True)), or give it another name (name=...)")


def _show(annotation: Annotation) -> str:
    return repr(annotation) if isinstance(annotation, str) else \
        f"computed by {getattr(annotation, '__qualname__', annotation)!r}"


def _validate(annotation: Annotation, label: str) -> None:
    if isinstance(annotation, str):
        try:
            parse_annotation(annotation)
        except AnnotationError as e:
            raise AnnotationError(f"{label}: {e.reason}", e.annotation, e.position) from None
    elif not callable(annotation):
        raise TypeError(f"{label}: an annotation must be a string or a callable, "
                        f"got {annotation!r}")


register_builtins(REGISTRY)
for _fn in (moe.routed_experts, moe.routed_experts.__nnscaler_op__):  # nnscaler's own op: no numeric check
    REGISTRY.register(_fn, moe.routed_experts_annotation, moe.ROUTED_EXPERTS)
