"""Walking the tensors of nested Python containers (tuples, named tuples, lists, dicts): forward
arguments and outputs, op arguments. One implementation for every package."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, List

import torch

__all__ = ["iter_leaves", "iter_tensors", "tensor_leaves", "map_tensors", "replace_tensors"]


def iter_leaves(obj: Any, kind: type, into_slices: bool = False) -> Iterator[Any]:
    """The instances of `kind` in ``obj`` in order (depth first through lists and tuples, dict
    values in insertion order, and with `into_slices` a slice's start, stop and step).

    Collected into a list first (the tracer and codegen walk every op's arguments: plain recursion
    costs a third of nested generators)."""
    found: List[Any] = []
    _collect(obj, kind, into_slices, found)
    return iter(found)


def _collect(obj: Any, kind: type, into_slices: bool, found: List[Any]) -> None:
    if isinstance(obj, kind):
        found.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _collect(x, kind, into_slices, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            _collect(x, kind, into_slices, found)
    elif into_slices and isinstance(obj, slice):
        _collect(obj.start, kind, into_slices, found)
        _collect(obj.stop, kind, into_slices, found)
        _collect(obj.step, kind, into_slices, found)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``obj`` in order (depth first; dict values in insertion order)."""
    return iter_leaves(obj, torch.Tensor)


def tensor_leaves(obj: Any) -> List[torch.Tensor]:
    """`iter_tensors` as a list (the order of a registry annotation's entries)."""
    return list(iter_tensors(obj))


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """A copy of ``obj`` with ``fn(t)`` in place of every tensor ``t``; containers keep their type
    (named tuples, dict subclasses where they can be rebuilt from items), ``torch.Size`` stays."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        items = [map_tensors(x, fn) for x in obj]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, dict):
        items = [(k, map_tensors(v, fn)) for k, v in obj.items()]
        try:
            return type(obj)(items)
        except TypeError:  # a dict subclass that cannot be built from items (defaultdict)
            return dict(items)
    return obj


def replace_tensors(obj: Any, new: Iterable[torch.Tensor]) -> Any:
    """``obj`` with its tensors replaced, in `iter_tensors` order, by those of ``new``."""
    it = iter(new)
    return map_tensors(obj, lambda _: next(it))
