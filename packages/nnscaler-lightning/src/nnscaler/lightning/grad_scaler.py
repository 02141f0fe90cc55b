"""NnScalerGradScaler: torch's `GradScaler` for parallel modules (fp16 precisions).

Two differences from ``torch.amp.GradScaler``:
- the inf/NaN check spans every rank: under tensor parallelism (or any plan where ranks hold
  different gradient pieces) one rank can see an overflow the others do not, and all of them
  must skip the step and lower the scale together. `unscale_` all-reduces (MAX) the found-inf
  flag over the default process group, once per optimizer step;
- fp16 gradients are unscaled too (``16-true`` trains fp16 parameters; torch's scaler refuses
  to unscale fp16 gradients);
- it unscales the gradients the optimizer steps on (offload.step_gradients), not blindly those
  of ``param_groups``: under ZeRO (``ComputeConfig(use_zero=True)``) the optimizer holds this
  rank's shards, whose gradients exist only once ``sync_shard_grad()`` set them from the
  parameters' (torch's scaler would find none, or last step's, and the step would then set them
  still scaled); `unscale_` sets them first and unscales those. Each rank checks its own shards;
  the all-reduce of the found-inf flag makes every rank skip the step together. With
  ``cpu_offload`` the gradients on the module's device are unscaled (before the copy).
The scaler's state (`state_dict`) is plain numbers: it goes into a checkpoint's JSON `extra`.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from nnscaler.runtime import step_gradients

__all__ = ["NnScalerGradScaler", "default_scaler"]


class NnScalerGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` (same constructor) whose overflow check spans every rank and
    which unscales fp16 gradients."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        assert self._scale is not None
        inv_scale = self._scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
        # the gradients the step consumes (ZeRO shards set first; not the offload copies)
        holder = SimpleNamespace(param_groups=[{"params": step_gradients(optimizer)}])
        per_device = self._unscale_grads_(holder, inv_scale, found_inf, True)  # True: fp16 grads too
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            total = torch.zeros((), dtype=torch.float32, device=self._scale.device)
            for flag in per_device.values():
                total += flag.to(total.device)
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
            per_device = {self._scale.device: total}
        elif not per_device:
            per_device = {self._scale.device: found_inf}
        state["found_inf_per_device"] = per_device
        state["stage"] = OptState.UNSCALED

    @classmethod
    def like(cls, scaler: Optional[torch.amp.GradScaler], device: str, precision: str) -> "NnScalerGradScaler":
        """Ours with the settings of `scaler` (a Lightning plugin's), or the defaults of `precision`."""
        if isinstance(scaler, cls):
            return scaler
        if scaler is None:
            return default_scaler(device, precision)
        return cls(device, init_scale=scaler._init_scale, growth_factor=scaler._growth_factor,
                   backoff_factor=scaler._backoff_factor, growth_interval=scaler._growth_interval,
                   enabled=scaler._enabled)


def default_scaler(device: str, precision: str, **kwargs: Any) -> NnScalerGradScaler:
    """``16-mixed``: torch's defaults (initial scale 2**16). ``16-true``: initial scale 2**10,
    since the loss itself is fp16 (max 65504) and 2**16 times any loss above 1 would overflow."""
    kwargs.setdefault("init_scale", 2.0 ** 16 if precision == "16-mixed" else 2.0 ** 10)
    return NnScalerGradScaler(device, **kwargs)
