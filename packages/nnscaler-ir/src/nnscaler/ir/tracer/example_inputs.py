"""What `trace` accepts, checked before the forward runs: errors that name the user's thing.

* An example input that is array-like but not a torch tensor (a NumPy array, a pandas object...)
  would reach the first torch op and fail there as ``linear(): argument 'input' (position 1) must
  be Tensor``; it is refused naming the argument (``dummy_forward_args['batch']['ids']``) and the
  conversion to use.
* Tensors generated code cannot hold: quantized dtypes (``torch.qint8``...) and non-strided layouts
  (sparse, mkldnn), as parameters, buffers or example inputs, are refused naming the tensor (the
  module path of a parameter or buffer) instead of failing somewhere in tracing or code generation.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

import torch

__all__ = ["check_trace_inputs", "check_example_inputs", "check_module_tensors"]


def check_trace_inputs(module, dummy_forward_args) -> None:
    """Both checks below (arguments of the wrong kind are left to `trace`'s own messages)."""
    if isinstance(module, torch.nn.Module):
        check_module_tensors(module)
    if isinstance(dummy_forward_args, dict):
        check_example_inputs(dummy_forward_args)


def check_example_inputs(dummy_forward_args: Dict[str, Any]) -> None:
    """Raise TypeError for an example input that is not a torch tensor but looks like an array."""
    for label, obj in _leaves(dummy_forward_args, "dummy_forward_args"):
        if isinstance(obj, torch.Tensor):
            _check_tensor(f"example input {label}", obj)
        elif _array_like(obj):
            kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
            shape = getattr(obj, "shape", None)
            conv = "torch.from_numpy(...)" if type(obj).__module__ == "numpy" else "torch.as_tensor(...)"
            raise TypeError(f"example input {label} is a {kind}{f' of shape {tuple(shape)}' if shape is not None else ''}, "
                            f"not a torch.Tensor: nnscaler traces torch ops on tensors. Pass {conv} instead (and "
                            f"tensors when calling the parallelized module)")


def check_module_tensors(module: torch.nn.Module) -> None:
    """Raise TypeError for a parameter or buffer of a kind the generated code cannot hold."""
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        kind = "parameter" if isinstance(t, torch.nn.Parameter) else "buffer"
        _check_tensor(f"{kind} {name!r} of {type(module).__qualname__}", t)


def _check_tensor(what: str, t: torch.Tensor) -> None:
    if t.is_quantized:
        raise TypeError(f"{what} is quantized ({t.dtype}); nnscaler parallelizes float and integer tensors only. "
                        f"Keep it in float (dequantize it, t.dequantize()) while parallelizing, and quantize the "
                        f"trained model afterwards")
    if t.layout is not torch.strided:
        raise TypeError(f"{what} has layout {t.layout}; nnscaler supports dense (strided) tensors only. "
                        f"Convert it with .to_dense() (store a sparse matrix as dense, or as index and value "
                        f"tensors)")


def _leaves(obj, label: str) -> Iterator[Tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{label}[{k!r}]")
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{label}[{i}]")
    else:
        yield label, obj


def _array_like(obj) -> bool:
    if isinstance(obj, (str, bytes, int, float, bool, complex)) or obj is None:
        return False
    return getattr(obj, "ndim", 0) != 0 and (hasattr(obj, "__array__") or hasattr(obj, "__array_interface__"))
