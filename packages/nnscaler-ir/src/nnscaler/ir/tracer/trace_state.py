"""What tracing does around the user's forward: the autocast region of each op, what the forward
changes on the model (buffers rebound, plain attributes, hooks that run only then), and putting
the model back as it was. (The grad mode of each op is the tracer's, with the help of
kept_functions.py for autograd Functions.)"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch

from ..errors import TraceError, TracingWarning
from ..graph import dtype_name
from ..user_code import warn_user
from .surface import TracerSurface

__all__ = ["SavedState", "autocast_region", "buffer_updates_of", "warn_module_hooks"]


def autocast_region() -> Optional[list]:
    """[device type, dtype name] of the autocast region the forward is in, or None."""
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            return [device_type, dtype_name(torch.get_autocast_dtype(device_type))]
    return None


def warn_module_hooks(module: torch.nn.Module) -> None:
    """Hooks on the model run while tracing only: what they compute into the output is traced,
    but their side effects (storing features, logging) and backward hooks are not in the program."""
    found = []
    for path, mod in module.named_modules():
        for kind, hooks in (("forward pre-hook", mod._forward_pre_hooks), ("forward hook", mod._forward_hooks),
                            ("backward hook", mod._backward_hooks), ("backward pre-hook", mod._backward_pre_hooks)):
            for hook in hooks.values():
                found.append(f"{kind} {getattr(hook, '__qualname__', type(hook).__name__)} on {path or 'the model'}")
    if found:
        warn_user(f"the model has hooks: {'; '.join(found)}. They run while tracing only: ops a forward hook "
                  f"applies to the output become part of the generated code, but side effects (storing, "
                  f"logging) and backward hooks do not run in it. Do that work in forward, or on the outputs",
                  TracingWarning)


def buffer_updates_of(tracer: TracerSurface, rebound, by_id) -> Dict[str, Any]:
    """Buffers the forward rebinds (``self.ema = self.ema * 0.9 + x``): buffer name -> new value."""
    updates = {}
    for mod, name, old, new in rebound:
        path = tracer.module_path(mod) or ""
        full = f"{path}.{name}" if path else name
        if old is None or id(old) not in by_id or not isinstance(new, torch.Tensor):
            raise TraceError(f"forward sets buffer {full} to {type(new).__name__} (it was "
                             f"{type(old).__name__}): a buffer must stay a tensor; give it its value in "
                             f"__init__ and update it in forward (self.{name} = new tensor, or in place)")
        updates[by_id[id(old)].name] = tracer.to_refs(new)
    return updates


_PLAIN = (bool, int, float, str, type(None))


class SavedState:
    """Parameters, buffers and RNG state, restored after tracing (the trace must not change the model).

    Buffers are copied up front (they are small); a parameter is copied just before the first
    in-place op that writes its storage (``w.div_(...)``, ``w.data.mul_(...)``, ``w[i] = ...``,
    ``out=w``), so tracing a large model does not hold a second copy of its weights."""

    def __init__(self, module):
        self.buffers = [(b, b.detach().clone()) for b in module.buffers() if b.device.type != "meta"]
        self.param_storage = {p.untyped_storage().data_ptr(): (n, p) for n, p in module.named_parameters()
                              if p.device.type != "meta" and p.numel() > 0}
        self.param_versions = {n: (p, p._version) for n, p in module.named_parameters()}
        self.params: Dict[str, tuple] = {}  # name -> (parameter, copy taken before the first write)
        # forward may also rebind a buffer (self.steps = self.steps + 1): put the original back
        self.slots = [(m, n, b) for m in module.modules() for n, b in m._buffers.items()]
        # plain Python attributes (a step counter): forward may change them, generated code cannot
        self.attrs = [(m, k, v) for m in module.modules() for k, v in m.__dict__.items()
                      if not k.startswith("_") and k != "training" and isinstance(v, _PLAIN)]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def before_write(self, target) -> None:
        """About to write `target` in place: copy the parameter whose storage it is (once)."""
        if not isinstance(target, torch.Tensor) or target.device.type == "meta":
            return
        hit = self.param_storage.get(target.untyped_storage().data_ptr())
        if hit is not None and hit[0] not in self.params:
            self.params[hit[0]] = (hit[1], hit[1].detach().clone())

    def unrestorable_params(self) -> list:
        """Parameters forward changed in place by a route the tracer did not see (no copy taken)."""
        return [n for n, (p, v) in self.param_versions.items() if p._version != v and n not in self.params]

    def changed_attributes(self, path_of: Callable[[torch.nn.Module], Optional[str]]) -> list:
        """'path.attr' of every plain attribute forward changed (`path_of`: a module's path)."""
        return [f"{path_of(m) + '.' if path_of(m) else ''}{k}" for m, k, v in self.attrs
                if k not in m.__dict__ or type(m.__dict__[k]) is not type(v) or m.__dict__[k] != v]

    def rebound(self):
        """(module, name, original, now) of every buffer slot forward rebound to another object."""
        return [(m, n, b, m._buffers.get(n)) for m, n, b in self.slots if m._buffers.get(n) is not b]

    def restore(self):
        for m, n, b in self.slots:
            m._buffers[n] = b
        for m, k, v in self.attrs:  # a counter or flag goes back; an object forward stored stays
            if isinstance(m.__dict__.get(k), _PLAIN):
                m.__dict__[k] = v
        with torch.no_grad():
            for b, v in self.buffers:  # one left as it was keeps its version counter (replay.py)
                if not (b.shape == v.shape and b.dtype == v.dtype and torch.equal(b, v)):
                    b.copy_(v)
            for p, v in self.params.values():
                p.copy_(v)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
