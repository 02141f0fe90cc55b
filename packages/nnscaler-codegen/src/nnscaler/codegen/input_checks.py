"""Checks, at the top of the generated forward, that a call's tensors fit what the program assumes.

With ``constant_folding=True`` every size the forward computed from its inputs is a constant of the
generated code (``x.view(4, 2, 8)``), so another batch size would run the traced program on the
wrong shapes: silently wrong where the shapes still line up (a mean over 4 of a batch of 8), an
obscure error elsewhere. The generated forward therefore refuses any tensor argument whose shape or
dtype differs from the traced one, naming the argument (``batch['ids']``) and the traced schema. A
float argument may come in another float dtype (a precision plugin such as ``bf16-true`` casts the
inputs before the forward); integer and bool arguments must have the traced dtype.

With constant folding off, sizes are recomputed from the runtime tensors; what stays fixed is the
rank (the code unpacks ``a, b, c = x.size()`` and splits tensors by dim index) and whether the dtype
is floating-point (ids given as floats would fail deep inside ``embedding()``), so only those are
checked and other batch sizes and lengths keep working.

Every argument: a tensor where a tensor was traced (a float or a list is named, not sent into
``linear()``); and where the program computed with a Python scalar (``scale=2.0`` given, or a default
used), that value, since it is a constant of the code (another one used to be ignored silently).

Each check is one or two comparisons: about 0.2-0.3 µs per argument on the 2-core CPU box, with or
without folding (``python tools/input_check_cost.py``).
"""
from __future__ import annotations

from typing import List

from nnscaler.ir import IRGraph

_FLOATS = {"float16", "bfloat16", "float32", "float64"}
_DTYPES = {"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
           "float64", "complex64", "complex128"}


def input_checks(graph: IRGraph) -> List[str]:
    """Lines of the generated forward that refuse tensor arguments the program was not traced for."""
    lines: List[str] = []
    for inp in graph.inputs:
        for path, ref in inp.leaves:
            value = graph.value(ref)
            if not value.is_tensor or value.shape is None:
                continue
            expr = inp.name + "".join(f"[{p!r}]" for p in path)
            shape = tuple(int(s) for s in value.shape)
            if graph.constant_folding:
                if value.dtype in _FLOATS:  # any float: precision plugins cast float inputs (bf16-true)
                    dtype_ok = f" or not {expr}.is_floating_point()"
                else:
                    dtype_ok = f" or {expr}.dtype != torch.{value.dtype}" if value.dtype in _DTYPES else ""
                lines.append(f"if not isinstance({expr}, torch.Tensor) or {expr}.shape != {shape!r}{dtype_ok}:")
                dtype = f"{value.dtype} (or another float dtype)" if value.dtype in _FLOATS else value.dtype
                tail = (f", but the model was traced with constant_folding=True on shape {shape}, dtype "
                        f"{dtype}: every size is a constant of the generated code, so it runs on that "
                        f"schema only. Pass inputs of the traced shape, or use constant_folding=False (sizes "
                        f"are then recomputed from the inputs) and generate again")
            else:
                floating = value.dtype in _FLOATS
                kind_ok = (f" or {'not ' if floating else ''}{expr}.is_floating_point()"
                           if value.dtype in _DTYPES and not value.dtype.startswith("complex") else "")
                kind = "a floating-point" if floating else "an integer/bool"
                lines.append(f"if not isinstance({expr}, torch.Tensor) or {expr}.dim() != {len(shape)}{kind_ok}:")
                tail = (f", but the model was traced with {len(shape)} dim(s) (shape {shape}) of {kind} dtype "
                        f"({value.dtype}): the generated code unpacks and splits its dims by position and runs "
                        f"the ops traced for that dtype. Pass such a tensor, or trace with such an input")
            lines.append(f"    raise ValueError({f'argument {expr} has '!r} + {_describe(expr)} + {tail!r})")
    for inp in graph.inputs:
        if inp.constant is not None:
            lines += _constant_check(inp.name, inp.constant[0], inp.traced)
    return lines


def _constant_check(name: str, value, traced: bool) -> List[str]:
    """Refuse another value where the program computed with a Python scalar (a constant of its code)."""
    if value is None or isinstance(value, bool):
        test = f"{name} is not {value!r}"
    elif isinstance(value, (int, float)):
        test = f"type({name}) not in (int, float) or {name} != {value!r}"
    else:
        test = f"type({name}) is not str or {name} != {value!r}"
    how = "traced with" if traced else "traced without it in dummy_forward_args, so with its default"
    tail = (f", but the model was {how} {name}={value!r}: a Python value (not a tensor) is a constant of the "
            f"generated code, which computed with {value!r}. Pass {name}={value!r}, or pass the value as a tensor "
            f"(torch.tensor(...)) in dummy_forward_args and in every call, so that it is an input of the "
            f"program, and generate again")
    return [f"if {test}:",
            f"    raise ValueError({f'argument {name} is '!r} + repr({name})[:80] + {tail!r})"]


def _describe(expr: str) -> str:
    """A generated expression describing what the call passed (its shape and dtype, or its type)."""
    return (f"('shape ' + str(tuple({expr}.shape)) + ', dtype ' + str({expr}.dtype).replace('torch.', '') "
            f"if isinstance({expr}, torch.Tensor) else 'type ' + type({expr}).__name__ + ', not a tensor')")
