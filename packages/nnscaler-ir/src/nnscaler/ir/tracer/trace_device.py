"""Where traced functions execute: the five trace strategies of ComputeConfig.

- ``cpu``: weights and intermediates on the CPU.
- ``meta``: weights stay where they are (the CPU, or the meta device for a module built under
  ``with torch.device("meta")``) and every function that reads a weight runs on meta twins of its
  inputs (shapes only, no compute); a function of the example inputs, constants and buffers alone
  runs on their real values (and so does a factory, ``torch.arange(n, device=x.device)``, sized by
  the example batch), so what the forward reads from the example batch in Python (an attention
  mask's ``.all()``, a position's ``.item()``) has a value to record a guard with.
- ``cuda``: weights and intermediates on the GPU.
- ``cuda_run_cpu_offload``: run on the GPU, retry a function on the CPU when it runs out of memory.
- ``reuse_cache``: like ``cuda_run_cpu_offload``, and a function called again with inputs of the
  same metadata (shape, dtype, stride, requires_grad) and equal constants returns the cached
  result instead of running (fast, but wrong for value-dependent functions such as nonzero).

Without a CUDA device the GPU strategies run on the CPU; a warning says so once per trace.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from ..errors import TraceError
from ..tree import iter_tensors as _tensors
from ..user_code import warn_user

_GPU_STRATEGIES = ("cuda", "cuda_run_cpu_offload", "reuse_cache")


class ExecutionDevice:
    def __init__(self, device: str, offload_on_oom: bool = False, cache: bool = False):
        self.device = torch.device(device)
        self.offload_on_oom = offload_on_oom
        self.cache: Optional[Dict] = {} if cache else None
        self._twins: Dict[int, tuple] = {}
        self._weights: set = set()  # ids of the module's parameters (meta: never computed for real)
        self.fallbacks = 0

    @classmethod
    def for_strategy(cls, strategy: str) -> "ExecutionDevice":
        if strategy == "cpu":
            return cls("cpu")
        if strategy == "meta":
            return cls("meta")
        if strategy in _GPU_STRATEGIES:
            if torch.cuda.is_available():
                return cls(f"cuda:{torch.cuda.current_device()}", offload_on_oom=strategy != "cuda",
                           cache=strategy == "reuse_cache")
            warn_user(f"trace_strategy {strategy!r} needs a CUDA device and none is present: tracing "
                          f"runs on the CPU instead (same graph, CPU speed)"
                          + (" with the reuse cache" if strategy == "reuse_cache" else ""))
            return cls("cpu", cache=strategy == "reuse_cache")
        raise ValueError(f"unknown trace_strategy {strategy!r}; use one of cpu, meta, cuda, "
                         f"cuda_run_cpu_offload, reuse_cache")

    @property
    def runs_in_place(self) -> bool:
        """Functions run on the forward's own tensors (the CPU, no cache): no copies, no reuse."""
        return self.device.type == "cpu" and self.cache is None

    # -- tensors ---------------------------------------------------------------------------------
    def twin(self, t: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
        """`t` on the execution device (cached, so a weight is copied once)."""
        device = device or self.device
        if t.device == device:
            return t
        key = (id(t), str(device))
        hit = self._twins.get(key)
        if hit is not None and hit[0] is t:
            return hit[1]
        copy = t.detach().to(device)
        if t.requires_grad and copy.is_floating_point():
            copy.requires_grad_(True)
        self._twins[key] = (t, copy)
        return copy

    def input_twin(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "meta" and t.device.type != "meta":  # the example batch keeps its values
            copy = t.detach().clone()
            return copy.requires_grad_(True) if t.requires_grad and copy.is_floating_point() else copy
        return self.twin(t)

    def mark_weights(self, tensors) -> None:
        """The module's parameters: under ``meta`` a function reading one never runs for real."""
        self._weights.update(id(t) for t in tensors)

    def _real_on_meta(self, args, kwargs) -> bool:
        """Under ``meta``: whether a call reads only real tensors that are not weights (the example
        batch, constants, buffers and what was computed from them alone), or no tensor at all (a
        factory such as ``torch.arange(n, device=x.device)``: sized by the example batch)."""
        if self.device.type != "meta":
            return False
        return all(t.device.type != "meta" and id(t) not in self._weights for t in _tensors((args, kwargs)))

    def _move(self, obj, device=None):
        if isinstance(obj, torch.Tensor):
            return self.twin(obj, device)
        if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
            moved = [self._move(x, device) for x in obj]
            if hasattr(obj, "_fields"):
                return type(obj)(*moved)
            return moved if isinstance(obj, list) else tuple(moved)
        if isinstance(obj, dict):
            return {k: self._move(v, device) for k, v in obj.items()}
        return obj

    # -- execution -------------------------------------------------------------------------------
    def run(self, func, args, kwargs, mode_off: bool = False):
        if self._real_on_meta(args, kwargs):  # "meta" is the trace's device: a move there stays real
            return _call(func, _meta_to_cpu(tuple(args)), _meta_to_cpu(dict(kwargs)), mode_off)
        args, kwargs = self._move(tuple(args)), self._move(dict(kwargs))
        key = self._cache_key(func, args, kwargs) if self.cache is not None else None
        if key is not None and key in self.cache:
            return _fresh(self.cache[key])
        try:
            out = _call(func, args, kwargs, mode_off)
        except torch.cuda.OutOfMemoryError:
            if not self.offload_on_oom:
                raise
            self.fallbacks += 1
            cpu = torch.device("cpu")
            out = _call(func, self._move(args, cpu), self._move(kwargs, cpu), mode_off)
        except (RuntimeError, NotImplementedError):
            if self.device.type == "meta" and _value_read(func):
                raise TraceError(
                    f"the forward reads the value of a tensor computed from the weights "
                    f"({getattr(func, '__name__', func)}), which under trace_strategy='meta' (always for a module "
                    f"built on the meta device) has none: decide with tensor ops instead (torch.where, masking), "
                    f"or build the module on the CPU and trace with trace_strategy='cpu'") from None
            raise
        if key is not None and not _is_inplace(out, args, kwargs):
            self.cache[key] = out
        return out

    def _cache_key(self, func, args, kwargs):
        try:
            return (id(func), _signature(args), _signature(kwargs))
        except TypeError:
            return None


def _call(func, args, kwargs, mode_off):
    if mode_off:
        with torch.overrides._pop_mode_temporarily():
            return func(*args, **kwargs)
    return func(*args, **kwargs)


_VALUE_READS = {"item", "__bool__", "__int__", "__float__", "__index__", "tolist", "__array__", "numpy",
                 "_local_scalar_dense"}


def _value_read(func) -> bool:
    return getattr(func, "__name__", "") in _VALUE_READS


def _meta_to_cpu(obj):
    """Device arguments naming ``meta`` replaced by the CPU (a real value moved to the trace's device)."""
    if isinstance(obj, torch.device) and obj.type == "meta" or obj == "meta":
        return torch.device("cpu")
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_meta_to_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _meta_to_cpu(v) for k, v in obj.items()}
    return obj


def _signature(obj):
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), obj.dtype, obj.stride(), obj.requires_grad, str(obj.device))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__,) + tuple(_signature(x) for x in obj)
    if isinstance(obj, dict):
        return ("dict",) + tuple((k, _signature(v)) for k, v in sorted(obj.items()))
    hash(obj)
    return (type(obj), obj)  # 2 and 2.0 (and True) are equal but give different dtypes


def _is_inplace(out, args, kwargs) -> bool:
    """A call returning None or one of its inputs (add_, __setitem__, relu(inplace=True)) mutates
    its input: it must run every time, and its result is the mutated input, not a copy."""
    if out is None:
        return True
    inputs = {id(t) for t in _tensors((args, kwargs))}
    return any(id(t) in inputs for t in _tensors(out))


def _fresh(out):
    """A cached result as new tensor objects (each graph value needs its own tensor)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (list, tuple)) and not isinstance(out, torch.Size):
        items = [_fresh(x) for x in out]
        if hasattr(out, "_fields"):
            return type(out)(*items)
        return items if isinstance(out, list) else tuple(items)
    return out
