"""Checks, at the top of the generated forward, that a call's tensors fit what the program assumes.

With ``constant_folding=True`` every size the forward computed from its inputs is a constant of the
generated code (``x.view(4, 2, 8)``), so another batch size would run the traced program on the
wrong shapes: silently wrong where the shapes still line up (a mean over 4 of a batch of 8), an
obscure error elsewhere. The generated forward therefore refuses any tensor argument whose shape or
dtype differs from the traced one, naming the argument (``batch['ids']``) and the traced schema. A
float argument may come in another float dtype (a precision plugin such as ``bf16-true`` casts the
inputs before the forward); integer and bool arguments must have the traced dtype.

With constant folding off, sizes are recomputed from the runtime tensors; what stays fixed is the
rank (the code unpacks ``a, b, c = x.size()`` and splits tensors by dim index), so only the number
of dims is checked and other batch sizes and lengths keep working.

The check is one comparison of ``tensor.shape`` with a tuple per tensor argument: about 0.3 µs each
(0.05-0.15 µs for the rank check without folding; ``python tools/input_check_cost.py``).
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
                lines.append(f"if not isinstance({expr}, torch.Tensor) or {expr}.dim() != {len(shape)}:")
                tail = (f", but the model was traced with {len(shape)} dim(s) (shape {shape}): the generated "
                        f"code unpacks and splits its dims by position. Pass a tensor with {len(shape)} dims, "
                        f"or trace with such an input")
            lines.append(f"    raise ValueError({f'argument {expr} has '!r} + {_describe(expr)} + {tail!r})")
    return lines


def _describe(expr: str) -> str:
    """A generated expression describing what the call passed (its shape and dtype, or its type)."""
    return (f"('shape ' + str(tuple({expr}.shape)) + ', dtype ' + str({expr}.dtype).replace('torch.', '') "
            f"if isinstance({expr}, torch.Tensor) else 'type ' + type({expr}).__name__)")
