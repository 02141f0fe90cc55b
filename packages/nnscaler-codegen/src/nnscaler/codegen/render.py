"""Rendering IR values and calls as Python source text."""
from __future__ import annotations

import math
from typing import Dict

import torch

from nnscaler.ir import Ref, dtype_name
from nnscaler.ir.contracts import GENERATED_ATTR_NAMES

# Dunder and operator-module calls rendered as infix/prefix Python operators.
BINARY = {"__add__": "+", "__sub__": "-", "__mul__": "*", "__truediv__": "/", "__floordiv__": "//",
          "__mod__": "%", "__pow__": "**", "__matmul__": "@", "__and__": "&", "__or__": "|", "__xor__": "^",
          "__eq__": "==", "__ne__": "!=", "__lt__": "<", "__le__": "<=", "__gt__": ">", "__ge__": ">=",
          "add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%"}
REVERSED = {"__radd__": "+", "__rsub__": "-", "__rmul__": "*", "__rtruediv__": "/", "__rfloordiv__": "//",
            "__rpow__": "**", "__rmatmul__": "@", "__rmod__": "%"}
UNARY = {"__neg__": "-", "neg": "-", "__invert__": "~", "__pos__": "+", "__abs__": "abs"}


class RawExpr:
    """A piece of generated code computed by codegen itself; subclasses define `render`."""

    def render(self, renderer: "Renderer") -> str:
        raise NotImplementedError


class ModeChoice(RawExpr):
    """A constant that depends on the module's mode: ``self.training``, ``(not self.training)`` or
    ``(a if self.training else b)``."""

    def __init__(self, train, eval_):
        self.train, self.eval = train, eval_

    def render(self, renderer: "Renderer") -> str:
        if self.train is True and self.eval is False:
            return "self.training"
        if self.train is False and self.eval is True:
            return "(not self.training)"
        return f"({renderer.value(self.train)} if self.training else {renderer.value(self.eval)})"


class Renderer:
    """Renders constants and Refs; `names` maps value ids to Python expressions."""

    def __init__(self, names: Dict[int, str]):
        self.names = names

    def value(self, obj, in_index: bool = False) -> str:
        if isinstance(obj, Ref):
            return self.names[obj.id]
        if isinstance(obj, RawExpr):
            return obj.render(self)
        if obj is None or isinstance(obj, (bool, str)):
            return repr(obj)
        if isinstance(obj, int):
            return repr(int(obj))
        if isinstance(obj, float):
            if math.isfinite(obj):
                return repr(obj)
            return f"float({repr(obj)!r})"
        if isinstance(obj, complex):
            return repr(obj)
        if isinstance(obj, torch.Size):
            return f"torch.Size({[int(x) for x in obj]!r})"
        if isinstance(obj, tuple):
            items = [self.value(x, in_index) for x in obj]
            if in_index:
                return ", ".join(items) if len(items) != 1 else items[0] + ","
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        if isinstance(obj, list):
            return "[" + ", ".join(self.value(x) for x in obj) + "]"
        if isinstance(obj, dict):
            return "{" + ", ".join(f"{self.value(k)}: {self.value(v)}" for k, v in obj.items()) + "}"
        if isinstance(obj, slice):
            parts = [self.value(x) if x is not None else "" for x in (obj.start, obj.stop, obj.step)]
            if in_index:
                return ":".join(parts[:2]) + (":" + parts[2] if parts[2] else "")
            return f"slice({self.value(obj.start)}, {self.value(obj.stop)}, {self.value(obj.step)})"
        if obj is Ellipsis:
            return "..."
        if isinstance(obj, torch.dtype):
            return f"torch.{dtype_name(obj)}"
        if isinstance(obj, torch.device):
            # The trace ran on one device; at run time tensors are created on the module's device.
            return "self.device"
        text = str(obj)
        if text.startswith("torch."):
            return text
        raise TypeError(f"cannot render constant {obj!r} of type {type(obj).__name__}")

    def call(self, target: str, args: list, kwargs: dict) -> str:
        """An expression calling `target` (a dotted path) on rendered arguments."""
        method = target.rsplit(".", 1)[-1]
        is_tensor_method = target.startswith("torch.Tensor.")
        is_operator = target.startswith("operator.")
        if (is_tensor_method or is_operator) and not kwargs:
            if method in BINARY and len(args) == 2:
                return f"({self.value(args[0])} {BINARY[method]} {self.value(args[1])})"
            if method in REVERSED and len(args) == 2:
                return f"({self.value(args[1])} {REVERSED[method]} {self.value(args[0])})"
            if method in UNARY and len(args) == 1:
                op = UNARY[method]
                return f"{op}({self.value(args[0])})" if op == "abs" else f"({op}{self.value(args[0])})"
            if method == "__getitem__" and len(args) == 2:
                return f"{self.value(args[0])}[{self.value(args[1], in_index=True)}]"
        if target == "getattr":
            return f"{self.value(args[0])}.{args[1]}"
        rendered = [self.value(a) for a in args] + [f"{k}={self.value(v)}" for k, v in kwargs.items()]
        if is_tensor_method and args and isinstance(args[0], Ref) and not method.startswith("__"):
            return f"{rendered[0]}.{method}({', '.join(rendered[1:])})"
        return f"{target}({', '.join(rendered)})"


def python_name(text: str, taken: set) -> str:
    """A fresh identifier derived from `text` (dots and odd characters become underscores)."""
    base = "".join(c if c.isalnum() or c == "_" else "_" for c in text) or "v"
    if base[0].isdigit():
        base = "_" + base
    name, i = base, 1
    while name in taken or _is_reserved(name):
        name = f"{base}_{i}"
        i += 1
    taken.add(name)
    return name


# Attributes of ParallelModule (besides nn.Module's) that a parameter name must not shadow; the
# generated class attributes come from the contract (nnscaler.ir.contracts.GENERATED_ATTRS).
_MODULE_ATTRS = {"device", "rank", "grid", "reducer", "fullmap", "full_aliases", "compute_config", "train_step",
                 "infer_step", "sync_grad_when", "load_full_state", "add_full_map", "add_full_alias",
                 "parameters_for_optimizer"} | GENERATED_ATTR_NAMES


def _is_reserved(name: str) -> bool:
    import builtins
    import keyword
    return (keyword.iskeyword(name) or name in {"self", "torch", "nr"} or hasattr(builtins, name)
            or name in _MODULE_ATTRS or hasattr(torch.nn.Module, name))
