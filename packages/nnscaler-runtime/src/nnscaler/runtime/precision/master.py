"""fp32 master weights for an optimizer over fp16/bf16 parameters."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ..class_mixin import mix_into, rewrap_scheduler_step
from ..errors import ConfigError
from ..gradients import clear_grads
from ..optimizer_state import MasterCopies, optimizer_state

from .settings import _LOW


# -- fp32 master weights ------------------------------------------------------------------------------

class MixedPrecisionOptimizer:
    """Mixed into the optimizer's class by `with_master_weights` (see the module docstring).

    Its state is `optimizer_state(opt).masters` (`MasterCopies`): (model parameter, fp32 master)
    for every fp16/bf16 parameter; the master replaces the parameter in `param_groups`. Master
    gradients exist only between `prepare_master_grads()` (called by step, clip_gnorm,
    scale_grads and GradScaler.unscale_) and the end of `step()` / `zero_grad()` /
    `GradScaler.update()`.
    """

    # GradScaler must take the unscale_ path (which calls prepare_master_grads), never the
    # fused-optimizer path that leaves unscaling to step().
    _step_supports_amp_scaling = False

    def _convert_group(self, group: Dict[str, Any]) -> None:
        state = optimizer_state(self)
        replicas, pairs = state.replicas, state.masters.pairs
        params = group["params"]
        for i, p in enumerate(params):
            if not (isinstance(p, torch.Tensor) and p.dtype in _LOW):
                continue
            master = torch.nn.Parameter(p.detach().to(torch.float32), requires_grad=p.requires_grad)
            params[i] = master
            pairs.append((p, master))
            if id(p) in replicas:  # build_optimizer's gradient-norm weights
                replicas[id(master)] = replicas[id(p)]
            if p in self.state:
                old = self.state.pop(p)
                self.state[master] = {k: v.to(torch.float32) if isinstance(v, torch.Tensor) and v.is_floating_point()
                                      and k != "step" else v for k, v in old.items()}

    @property
    def master_params(self) -> List[torch.Tensor]:
        """The fp32 masters, in the order of the low-precision parameters they stand for."""
        return [m for _, m in _masters(self).pairs]

    def master_of(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The fp32 master of a model parameter (None when it has none)."""
        return next((m for p, m in _masters(self).pairs if p is param), None)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        state = optimizer_state(self)
        if state is not None and state.masters is not None:  # not during the base __init__
            self._convert_group(self.param_groups[-1])

    def prepare_master_grads(self) -> None:
        """Upcast the model parameters' gradients into the masters' `.grad` (once per step).
        Completes pending ZeRO shard gradients first (`sync_shard_grad`, when the optimizer has it)."""
        masters = _masters(self)
        if masters.grads_ready:
            return
        sync_shard_grad = getattr(self, "sync_shard_grad", None)
        if sync_shard_grad is not None:
            sync_shard_grad()
        with torch.no_grad():
            for p, m in masters.pairs:
                if p.grad is None:
                    m.grad = None
                elif m.grad is None or m.grad.shape != p.grad.shape:
                    m.grad = p.grad.detach().to(torch.float32)
                else:
                    m.grad.copy_(p.grad)
        masters.grads_ready = True

    def release_master_grads(self) -> None:
        """Drop the masters' gradients (the model's stay)."""
        masters = _masters(self)
        for _, m in masters.pairs:
            m.grad = None
        masters.grads_ready = False

    def step(self, closure=None):
        loss = None
        if closure is not None:  # evaluated once, then the masters step on its gradients
            with torch.enable_grad():
                loss = closure()
        self.prepare_master_grads()
        super().step()
        with torch.no_grad():
            for p, m in _masters(self).pairs:
                p.copy_(m)  # round to nearest
        self.release_master_grads()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.release_master_grads()
        super().zero_grad(set_to_none=set_to_none)
        clear_grads([p for p, _ in _masters(self).pairs], set_to_none)

    def clip_gnorm(self, max_norm: Optional[float] = None) -> torch.Tensor:
        """Gradient norm (and clipping) over the fp32 master gradients; see build_optimizer."""
        self.prepare_master_grads()
        parent = super()
        if hasattr(parent, "clip_gnorm"):
            return parent.clip_gnorm(max_norm)
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, float("inf") if max_norm is None else max_norm)

    def scale_grads(self, factor: float) -> None:
        self.prepare_master_grads()
        parent = super()
        if hasattr(parent, "scale_grads"):
            return parent.scale_grads(factor)
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.grad.mul_(factor)

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state dict (state of the masters, fp32) plus
        `'master_weights'`: {parameter index (as in 'state'): fp32 master}."""
        sd = super().state_dict()
        index, masters, seen = 0, {}, {}
        master_ids = {id(m) for _, m in _masters(self).pairs}
        for group in self.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), index)
                if id(p) in master_ids:
                    masters[seen[id(p)]] = p.detach()
                index += 1
        sd["master_weights"] = masters
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads the inner state; masters from `'master_weights'` when present (the model's
        parameters are then set to them, rounded), else from the model's parameters."""
        state_dict = dict(state_dict)
        saved = state_dict.pop("master_weights", None)
        super().load_state_dict(state_dict)
        index, positions = 0, {}
        for group in self.param_groups:
            for p in group["params"]:
                positions.setdefault(id(p), index)
                index += 1
        with torch.no_grad():
            for p, m in _masters(self).pairs:
                i = positions.get(id(m))
                if saved is not None and i in saved:
                    m.copy_(saved[i])
                    p.copy_(m)
                else:
                    m.copy_(p)
        self.release_master_grads()


def _masters(optimizer) -> MasterCopies:
    return optimizer_state(optimizer).masters


MixedPrecisionOptimizer.step.hooked = True  # step pre/post hooks run around the inner step (masters)

def with_master_weights(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make `optimizer` keep fp32 master weights for its fp16/bf16 parameters; returns the same
    object, now also an instance of `MixedPrecisionOptimizer` (and still of its own class, e.g.
    `torch.optim.Adam`, with build_optimizer's methods). Idempotent. Existing state is moved to
    the masters and upcast. May be called after an LR scheduler was created on it."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"with_master_weights: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, MixedPrecisionOptimizer):
        return optimizer
    patched = optimizer.__dict__.get("step")
    if patched is not None and not getattr(patched, "_wrapped_by_lr_sched", False):
        raise ConfigError(f"with_master_weights: {type(optimizer).__name__}.step was replaced on the instance; "
                          f"call with_master_weights before wrapping step")
    mix_into(optimizer, MixedPrecisionOptimizer, "MasterWeights")
    optimizer.__dict__.pop("_step_supports_amp_scaling", None)  # fused optimizers set it: unscale_ path
    optimizer_state(optimizer, create=True).masters = MasterCopies()
    for group in optimizer.param_groups:
        optimizer._convert_group(group)
    if patched is not None:  # an LR scheduler wrapped the old class's step: wrap the new one
        rewrap_scheduler_step(optimizer)
    return optimizer
