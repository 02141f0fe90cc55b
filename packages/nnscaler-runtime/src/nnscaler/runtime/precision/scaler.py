"""Loss scaling shared by all ranks, and the plug-in the Trainer and the Lightning strategy call."""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Mapping, Optional, Union

import torch
import torch.distributed as dist

from ..device import default_device, is_distributed

from .settings import PrecisionConfig, parse_precision
from .casting import apply_precision, autocast, cast_inputs
from .master import MixedPrecisionOptimizer, with_master_weights


# -- loss scaling -------------------------------------------------------------------------------------

class GradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` for nnscaler (see the module docstring): unscales master gradients
    of a `with_master_weights` optimizer, fp16 gradients too, and agrees on inf/nan across the
    ranks of `process_group` (default: all ranks; the check is then collective: every rank must
    call unscale_/step). `device`: 'cpu' or 'cuda' (default: the runtime's device type).

    `last_step_skipped`: whether the last `step()` was skipped; `skipped_steps`: how many were.
    """

    def __init__(self, device: Optional[str] = None, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 process_group=None, sync_found_inf: bool = True):
        device = device if device is not None else default_device().type
        super().__init__(str(torch.device(device).type), init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self.process_group = process_group
        self.sync_found_inf = sync_found_inf
        self.last_step_skipped = False
        self.skipped_steps = 0
        self._mp_seen: List[weakref.ref] = []

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state["_mp_seen"] = []
        state["process_group"] = None  # process groups do not pickle: the default group after loading
        return state

    def _ensure_scale(self) -> None:
        """Create the scale on a rank that never scaled a loss itself: a pipeline stage before the
        one computing the loss still receives scaled gradients and must unscale them alike."""
        if self.is_enabled() and self._scale is None:
            device = torch.device(self._device)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self._lazy_init_scale_growth_tracker(device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self._ensure_scale()
        if self.is_enabled() and isinstance(optimizer, MixedPrecisionOptimizer):
            optimizer.prepare_master_grads()
            self._mp_seen.append(weakref.ref(optimizer))
        super().unscale_(optimizer)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, True)
        if not (self.sync_found_inf and is_distributed() and dist.get_world_size(self.process_group) > 1):
            return per_device
        total = torch.zeros_like(found_inf)
        for value in per_device.values():
            total += value.to(total.device)
        dist.all_reduce(total, group=self.process_group)
        return {total.device: total}

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        if not self.is_enabled():
            self.last_step_skipped = False
            return optimizer.step(*args, **kwargs)
        self._ensure_scale()
        retval = super().step(optimizer, *args, **kwargs)  # calls our unscale_ when not yet done
        self.last_step_skipped = _step_skipped(self, optimizer)
        self.skipped_steps += int(self.last_step_skipped)
        return retval

    def update(self, new_scale=None) -> None:
        self._ensure_scale()
        super().update(new_scale)
        for ref in self._mp_seen:  # a skipped step leaves the unscaled master grads behind
            opt = ref()
            if opt is not None:
                opt.release_master_grads()
        self._mp_seen.clear()


def _step_skipped(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether scaler.step(optimizer) (just called, before update) skipped the step."""
    if not scaler.is_enabled():
        return False
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    return bool(sum(v.item() for v in found.values()))


# -- the plug-in the Trainer and the Lightning strategy call -----------------------------------------

class PrecisionPlugin:
    """Everything precision does in a training loop, for the Trainer and the Lightning strategy.

        plugin = PrecisionPlugin('16-mixed')
        pm = plugin.setup_module(pm)                  # apply_precision
        opt = plugin.setup_optimizer(opt)             # fp32 masters when asked (or for fp16 params)
        loss = pm(**batch)
        plugin.backward(loss)                         # scaled when there is a grad scaler
        plugin.clip_gnorm(opt, max_norm)              # unscales first
        stepped = plugin.step(opt)                    # False when skipped on inf/nan
        opt.zero_grad()

    `grad_scaler`: None = as the config says; False = none; True = a new GradScaler; or a
    (torch.amp.)GradScaler instance to use. `master_weights`: None = only when params are fp16
    (pure fp16 Adam is unusable: eps and squared gradients underflow); True/False force it.
    """

    def __init__(self, precision: Union[None, str, Mapping[str, Any], PrecisionConfig] = None, *,
                 grad_scaler: Union[None, bool, torch.amp.GradScaler] = None,
                 master_weights: Optional[bool] = None, device: Optional[str] = None):
        self.config = parse_precision(precision)
        self.device_type = device if device is not None else default_device().type
        if grad_scaler is None:
            grad_scaler = self.config.grad_scaler
        if grad_scaler is True:
            grad_scaler = GradScaler(self.device_type)
        self.scaler: Optional[torch.amp.GradScaler] = grad_scaler or None
        self.master_weights = master_weights
        self._unscaled: set = set()

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return apply_precision(module, self.config)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        master = self.master_weights
        if master is None:
            master = self.config.param == torch.float16
        return with_master_weights(optimizer) if master else optimizer

    def convert_input(self, obj: Any) -> Any:
        return cast_inputs(obj, self.config)

    def forward_context(self):
        """Autocast for code outside the module's forward (the module itself is wrapped)."""
        return autocast(self.config, self.device_type)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        self.scale_loss(loss).backward(*args, **kwargs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients (once per step); required before clipping or reading them."""
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def clip_gnorm(self, optimizer: torch.optim.Optimizer, max_norm: Optional[float] = None) -> torch.Tensor:
        """Unscale, then the global gradient norm / clipping (`optimizer.clip_gnorm` of
        build_optimizer, else torch.nn.utils.clip_grad_norm_ over the optimizer's params)."""
        self.unscale_(optimizer)
        if hasattr(optimizer, "clip_gnorm"):
            return optimizer.clip_gnorm(max_norm)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, float("inf") if max_norm is None else max_norm)

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs) -> bool:
        """optimizer.step (through the scaler, which skips it on inf/nan and updates the scale);
        returns whether the parameters were updated."""
        self._unscaled.discard(id(optimizer))
        if self.scaler is None:
            optimizer.step(*args, **kwargs)
            return True
        self.scaler.step(optimizer, *args, **kwargs)
        skipped = _step_skipped(self.scaler, optimizer)
        self.scaler.update()
        return not skipped

    def state_dict(self) -> Dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
