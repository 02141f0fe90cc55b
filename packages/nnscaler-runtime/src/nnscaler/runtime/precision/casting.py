"""Casting a module's tensors and inputs, and running its forward under autocast."""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Mapping, Optional, Union

import torch

from nnscaler.ir import map_tensors

from ..device import default_device
from ..errors import ConfigError

from .settings import PrecisionConfig, _LOW, parse_precision


# -- module and inputs --------------------------------------------------------------------------------

def _map_floating(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` applied to every floating tensor in nested containers (nnscaler.ir.tree.map_tensors)."""
    return map_tensors(obj, lambda t: fn(t) if t.is_floating_point() else t)


def _caster(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t if t.dtype == dtype else t.to(dtype)


def cast_inputs(obj: Any, config: Union[PrecisionConfig, str, Mapping, None]) -> Any:
    """`obj` (a tensor, or tensors nested in tuples/lists/dicts) with every floating tensor cast
    to the config's input dtype; non-floating tensors and other objects unchanged. Use it on the
    dummy inputs before tracing a model that runs in that precision."""
    dtype = parse_precision(config).input
    return obj if dtype is None else _map_floating(obj, _caster(dtype))


def cast_module(module: torch.nn.Module, config: Union[PrecisionConfig, str, Mapping, None]) -> torch.nn.Module:
    """Cast the floating parameters (and their gradients) and buffers of `module` in place to the
    config's param / buffer dtypes; no hooks. Parameter objects are kept (their `.data` changes)."""
    config = parse_precision(config)
    with torch.no_grad():
        for sub in module.modules():
            if config.param is not None:
                for p in sub._parameters.values():
                    if p is not None and p.is_floating_point() and p.dtype != config.param:
                        grad = p.grad
                        p.grad = None
                        p.data = p.data.to(config.param)
                        if grad is not None:
                            p.grad = grad.to(config.param)
            if config.buffer is not None:
                for name, b in sub._buffers.items():
                    if b is not None and b.is_floating_point() and b.dtype != config.buffer:
                        sub._buffers[name] = b.to(config.buffer)
    return module


def _device_type(module: torch.nn.Module) -> str:
    device = getattr(module, "device", None)
    if isinstance(device, torch.device):
        return device.type
    for t in module.parameters():
        return t.device.type
    for t in module.buffers():
        return t.device.type
    return default_device().type


def autocast(config: Union[PrecisionConfig, str, Mapping, None], device_type: Optional[str] = None):
    """The autocast context of a mixed config (`torch.autocast(device_type, compute_dtype)`), a
    null context otherwise."""
    config = parse_precision(config)
    if not config.mixed:
        return contextlib.nullcontext()
    return torch.autocast(device_type or default_device().type, dtype=config.compute_dtype)


def cast_outputs(obj: Any, config: Union[PrecisionConfig, str, Mapping, None]) -> Any:
    """`obj` with its fp16/bf16 floating tensors as fp32 in a mixed config (what a module with
    that precision applied returns), unchanged otherwise."""
    return _map_floating(obj, _to_fp32) if parse_precision(config).mixed else obj


class _PrecisionRecord:
    """A forward pre-hook that does nothing: it carries the module's precision config (what
    `get_precision` reads), so that the config travels with the module (deepcopy, pickle) and
    nothing is stored on the module itself."""

    def __init__(self, config: PrecisionConfig):
        self.config = config

    def __call__(self, module, args):
        return None


class _CastInputs:
    """Forward pre-hook (with kwargs): floating tensor inputs -> `dtype`. Picklable."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, module, args, kwargs):
        cast = _caster(self.dtype)
        return _map_floating(args, cast), _map_floating(kwargs, cast)


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _LOW else t


class _Autocast:
    """Enters `torch.autocast` in a forward pre-hook and leaves it in a forward hook registered
    with `always_call=True` (so an exception in forward leaves it too); the hook also returns
    fp16/bf16 floating outputs as fp32. One stack of open contexts per thread (autocast state is
    thread-local; a module may be called recursively). Picklable and deep-copyable, so a module
    with precision applied still is."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._local = threading.local()

    def __getstate__(self):
        return {"dtype": self.dtype}

    def __setstate__(self, state):
        self.__init__(state["dtype"])

    def enter(self, module, args):
        ctx = torch.autocast(_device_type(module), dtype=self.dtype)
        ctx.__enter__()
        self._local.__dict__.setdefault("stack", []).append(ctx)

    def exit(self, module, args, output):
        stack = self._local.__dict__.get("stack")
        if stack:
            stack.pop().__exit__(None, None, None)
        return None if output is None else _map_floating(output, _to_fp32)


def apply_precision(module: torch.nn.Module, config: Union[PrecisionConfig, str, Mapping, None]) -> torch.nn.Module:
    """Run `module` in `config`'s precision; returns the module (changed in place).

    Casts floating parameters/buffers (`cast_module`), installs a forward pre-hook casting
    floating tensor inputs to `config.input`, and in mixed mode runs forward under
    `torch.autocast(<module's device type>, dtype=config.compute_dtype)` (forward hooks; the
    module's forward itself is not replaced) returning fp16/bf16 floating outputs as fp32.
    Applying again replaces the previous hooks (parameters already cast stay cast);
    `remove_precision(module)` removes them.
    """
    config = parse_precision(config)
    if config.mixed and not torch.amp.is_autocast_available(_device_type(module)):
        raise ConfigError(f"precision {config.describe()}: torch.autocast is not available on device type "
                          f"{_device_type(module)!r}")
    remove_precision(module)
    cast_module(module, config)
    module.register_forward_pre_hook(_PrecisionRecord(config))
    if config.input is not None:
        module.register_forward_pre_hook(_CastInputs(config.input), with_kwargs=True)
    if config.mixed:
        hook = _Autocast(config.compute_dtype)
        module.register_forward_pre_hook(hook.enter)  # after the input cast
        module.register_forward_hook(hook.exit, prepend=True, always_call=True)
    return module


def _ours(hook) -> bool:
    return isinstance(getattr(hook, "__self__", hook), (_PrecisionRecord, _CastInputs, _Autocast))


def remove_precision(module: torch.nn.Module) -> None:
    """Remove the input cast and autocast that apply_precision installed (dtypes stay)."""
    ids = precision_hook_ids(module)
    for table in (module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs, module._forward_hooks,
                  module._forward_hooks_with_kwargs, module._forward_hooks_always_called):
        for hook_id in ids:
            table.pop(hook_id, None)


def get_precision(module: torch.nn.Module) -> Optional[PrecisionConfig]:
    """The config apply_precision installed on `module`, or None."""
    return next((h.config for h in module._forward_pre_hooks.values() if isinstance(h, _PrecisionRecord)), None)


def precision_hook_ids(module: torch.nn.Module) -> set:
    """Ids of the forward (pre-)hooks apply_precision registered on `module`."""
    return {i for table in (module._forward_pre_hooks, module._forward_hooks) for i, h in table.items() if _ours(h)}
