"""Dotted, importable names for the functions the tracer sees (``torch.nn.functional.linear``)."""
from __future__ import annotations

import functools
import importlib
import operator
from typing import Callable, Dict

import torch


@functools.lru_cache(maxsize=1)
def _torch_table() -> Dict[int, str]:
    table: Dict[int, str] = {}
    spaces = [
        ("torch.nn.functional", torch.nn.functional),
        ("torch", torch),
        ("torch.linalg", torch.linalg),
        ("torch.special", torch.special),
        ("torch.fft", torch.fft),
        ("operator", operator),
    ]
    for prefix, ns in spaces:
        for name in dir(ns):
            if name.startswith("__") and prefix != "operator":
                continue
            try:
                obj = getattr(ns, name)
            except Exception:  # some torch attributes raise on access
                continue
            if callable(obj) and not isinstance(obj, type):
                table.setdefault(id(obj), f"{prefix}.{name}")
    # Tensor methods: the objects handed to __torch_function__ are the descriptors themselves.
    for cls in (torch._C.TensorBase, torch.Tensor):
        for name, obj in vars(cls).items():
            if callable(obj) or hasattr(obj, "__get__"):
                table.setdefault(id(obj), f"torch.Tensor.{name}")
    return table


def op_name(func: Callable) -> str:
    """The dotted path under which generated code can call `func`."""
    name = _torch_table().get(id(func))
    if name is not None:
        return name
    module = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if module and qualname:
        if module.startswith("torch._C") and qualname.startswith("_TensorBase."):
            return "torch.Tensor." + qualname.split(".", 1)[1]
        return f"{module}.{qualname}"
    raise TypeError(f"cannot give an importable name to {func!r}")


def policy_name(policy) -> str:
    """A stable name for a policy, a name or a function (recorded in the gen_savedir manifest)."""
    if isinstance(policy, str):
        return policy
    return f"{getattr(policy, '__module__', '?')}.{getattr(policy, '__qualname__', repr(policy))}"


def module_of(path: str) -> str:
    """The module part of a dotted path (``pkg.mod.Class.apply`` -> ``pkg.mod``): its longest
    importable prefix."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        return ".".join(parts[:cut])
    raise ImportError(f"cannot import {path}")


def resolve(path: str):
    """Import the object named by a dotted path (module part found by trying prefixes)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"cannot import {path}")
