"""Optimizer offload: a simplified ZeRO-Offload, shared by plain users, the Trainer and Lightning
(``NnScalerStrategy(cpu_offload=True)``).

`offload_optimizer(opt, device)` takes an optimizer built by `build_optimizer`
(over the parallel module's parameters, or over this rank's ZeRO shards) and makes it step on
fp32 *copies* of those tensors on `device` (the CPU for the strategies), so that its state (Adam's
moments, momentum buffers, ...) lives on `device` only:

- ``param_groups`` hold the copies, in place of the tensors they stand for (same positions, same
  group dicts, same optimizer object): LR schedulers keep working, and ``state_dict()`` /
  ``load_state_dict()`` index the state as before (nnscaler.ckpt saves and loads it by index;
  under ZeRO by the shard layout's ``state_index``, which is unchanged);
- the gradients stay on the module's device until the step: ``clip_gnorm``, ``scale_grads``,
  the grad scaler's ``unscale_`` and clipping by value act on them there (`step_gradients`), so
  they are synchronised, unscaled and clipped before they are copied;
- ``step()`` (after the closure, if any) copies each gradient into its copy's ``.grad`` (cast
  to fp32), runs the optimizer's own step on `device`, and copies the updated values back into
  the module's parameters on their device (under ZeRO the engine's all-gather reads the copies:
  ``ZeroEngine.gather_params`` reads whatever ``param_groups`` holds); the copies' gradients are
  then dropped;
- a parameter changed outside the optimizer (a checkpoint loaded into the module, weights set
  by the user) is seen at the next step through its version counter and its copy refreshed;
  ``load_state_dict`` refreshes every copy.

On a CUDA module with ``device="cpu"`` this is GPU->CPU gradient copies and CPU->GPU parameter
copies; on a CPU module the same machinery runs with CPU copies (which is how it is tested).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from .class_mixin import mix_into, rewrap_scheduler_step
from .errors import ConfigError
from .gradients import clear_grads
from .optimizer_state import OffloadCopies, optimizer_state

__all__ = ["OffloadedOptimizer", "offload_optimizer", "step_gradients"]


class OffloadedOptimizer:
    """Mixed into the optimizer's class by `offload_optimizer` (see the module docstring). Its
    state is `optimizer_state(opt).offload` (`OffloadCopies`)."""

    _step_supports_amp_scaling = False  # GradScaler must unscale_ first (on the device gradients)

    @property
    def offload_device(self) -> torch.device:
        """Where the copies (and so the optimizer state) live."""
        return _copies(self).device

    @property
    def offload_sources(self) -> List[torch.Tensor]:
        """The tensors whose gradients the step consumes (the module's parameters, or this rank's
        ZeRO pieces), in ``param_groups`` order."""
        return [s for s, _ in _copies(self).pairs]

    @property
    def offload_copies(self) -> List[torch.Tensor]:
        """The fp32 copies on the offload device the optimizer steps on."""
        return [c for _, c in _copies(self).pairs]

    @contextmanager
    def _on_sources(self):
        """``param_groups`` showing the device tensors (for gradient operations written against
        ``param_groups``: build_optimizer's ``clip_gnorm`` / ``scale_grads``)."""
        lookup = {id(c): s for s, c in _copies(self).pairs}
        saved = [g["params"] for g in self.param_groups]
        for g in self.param_groups:
            g["params"] = [lookup.get(id(p), p) for p in g["params"]]
        try:
            yield
        finally:
            for g, params in zip(self.param_groups, saved):
                g["params"] = params

    def clip_gnorm(self, max_norm: Optional[float] = None) -> torch.Tensor:
        """As build_optimizer's, on the gradients on the module's device (before the copy)."""
        with self._on_sources():
            return super().clip_gnorm(max_norm)

    def scale_grads(self, factor: float) -> None:
        with self._on_sources():
            return super().scale_grads(factor)

    def _read(self, i: int) -> torch.Tensor:
        tensor, span = _copies(self).reads[i]
        t = tensor.detach()
        return t if span is None else t.reshape(-1)[span[0]:span[1]]

    def refresh_offload(self, force: bool = True) -> None:
        """Copy the module's current values into the copies (only those changed since the copies
        last matched them, unless `force`)."""
        copies = _copies(self)
        with torch.no_grad():
            for i, (_, copy) in enumerate(copies.pairs):
                tensor = copies.reads[i][0]
                if force or tensor._version != copies.versions[i]:
                    copy.copy_(self._read(i))
                    copies.versions[i] = tensor._version

    def _grads_to_copies(self) -> None:
        sync = getattr(self, "sync_shard_grad", None)
        if sync is not None:
            sync()  # ZeRO: the shard gradients (no-op when already set)
        with torch.no_grad():
            for src, copy in _copies(self).pairs:
                g = src.grad
                if g is None:
                    copy.grad = None
                elif copy.grad is None:
                    copy.grad = torch.empty(copy.shape, dtype=copy.dtype, device=copy.device,
                                            pin_memory=copy.is_pinned()).copy_(g.detach().reshape(copy.shape))
                else:
                    copy.grad.copy_(g.detach().reshape(copy.shape))

    def step(self, closure=None):
        """Closure (forward, backward, clipping), gradients to the copies, the optimizer's step
        on the offload device, values back to the module (all-gathered under ZeRO)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.refresh_offload(force=False)
        self._grads_to_copies()
        super().step()  # build_optimizer's: under ZeRO it all-gathers from the copies
        copies = _copies(self)
        with torch.no_grad():
            if optimizer_state(self).zero is None:
                for src, copy in copies.pairs:
                    src.copy_(copy)
            for i, (_, copy) in enumerate(copies.pairs):
                copy.grad = None
                copies.versions[i] = copies.reads[i][0]._version
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # the copies' (and under ZeRO the parameters' and pieces')
        clear_grads(self.offload_sources, set_to_none)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """The state (moved to the offload device by torch, as the copies'), then every copy
        refreshed from the module (a checkpoint loads the module first)."""
        super().load_state_dict(state_dict)
        self.refresh_offload(force=True)


def _copies(optimizer) -> OffloadCopies:
    return optimizer_state(optimizer).offload


OffloadedOptimizer.step.hooked = True  # the inner step (torch-wrapped) runs the step hooks


def _pin(src: torch.Tensor, device: torch.device) -> bool:
    """Host copies of CUDA tensors live in pinned (page-locked) memory: the copies between the GPU
    and them then go by DMA at full bus speed instead of through a staging buffer."""
    return device.type == "cpu" and src.is_cuda and torch.cuda.is_available()


def offload_optimizer(optimizer: torch.optim.Optimizer, device: Union[str, torch.device] = "cpu"
                      ) -> torch.optim.Optimizer:
    """Make `optimizer` (from build_optimizer, state still empty) step on fp32 copies on `device`;
    returns the same object, now also an `OffloadedOptimizer`. Idempotent for the same device."""
    device = torch.device(device)
    if isinstance(optimizer, OffloadedOptimizer):
        if optimizer.offload_device != device:
            raise ConfigError(f"offload_optimizer: the optimizer is offloaded to {optimizer.offload_device} "
                              f"already, not {device}; offload it once, to one device")
        return optimizer
    state = optimizer_state(optimizer)
    if state is None or state.module is None:
        raise ConfigError(f"offload_optimizer needs the optimizer built by nnscaler.runtime.build_optimizer, "
                          f"got {type(optimizer).__name__}: build it with build_optimizer(module, ...)")
    if any(optimizer.state.values()):
        raise ConfigError("offload_optimizer: the optimizer already has state; offload it before it steps")
    zero = state.zero
    # ZeRO-1 pieces are views of the parameters (read from them); use_zero=3 pieces are the storage
    pieces = {id(p.tensor): p for p in zero.pieces} if zero is not None and not getattr(zero, "owns_storage", False) \
        else {}
    replicas = state.replicas
    pairs, reads = [], []
    for group in optimizer.param_groups:
        params = group["params"]
        for i, src in enumerate(params):
            copy = torch.empty(src.shape, dtype=torch.float32, device=device, pin_memory=_pin(src, device))
            with torch.no_grad():
                copy.copy_(src.detach())
            copy = torch.nn.Parameter(copy, requires_grad=src.requires_grad)
            params[i] = copy
            pairs.append((src, copy))
            piece = pieces.get(id(src))
            reads.append((piece.param.param, (piece.start, piece.stop)) if piece is not None else (src, None))
            replicas[id(copy)] = replicas.get(id(src), 1)
    patched = optimizer.__dict__.get("step")
    mix_into(optimizer, OffloadedOptimizer, "Offloaded")
    optimizer.__dict__.pop("_step_supports_amp_scaling", None)
    state.offload = OffloadCopies(device, pairs, reads, [t._version for t, _ in reads])
    if patched is not None:
        rewrap_scheduler_step(optimizer)
    return optimizer


def step_gradients(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """The tensors whose ``.grad`` the coming step consumes, with those gradients ready: under
    ZeRO the shard gradients are set first (``sync_shard_grad``), with offload the tensors on the
    module's device (not the copies, whose gradients come at the step). What the grad scaler
    unscales and what clipping by value clips."""
    sync = getattr(optimizer, "sync_shard_grad", None)
    if sync is not None:
        sync()
    if isinstance(optimizer, OffloadedOptimizer):
        return optimizer.offload_sources
    return [p for g in optimizer.param_groups for p in g["params"]]
