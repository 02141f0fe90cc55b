"""The optimizer of `configure_optimizers`, rebuilt over the parallel parameters.

`configure_optimizers` runs on the user's (single-device) module, before conversion, so it may
name any of its submodules. Its optimizer must cover exactly the trainable parameters, in one
parameter group; at most one optimizer and one LR scheduler (the limits of the design). The
same optimizer object is then re-pointed at this rank's parameters (or ZeRO shards) through
`nnscaler.runtime.build_optimizer`, so its class, hyper-parameters and the scheduler bound to it
stay as the user made them.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple, Union

import torch
from nnscaler.runtime import build_optimizer, mix_into, offload_optimizer, rewrap_scheduler_step

from .errors import NnScalerLightningError
from .internals import init_optimizers_and_lr_schedulers

__all__ = ["user_optimizer", "check_optimizer", "rebuild"]


def user_optimizer(module: torch.nn.Module) -> Tuple[Any, List[Any]]:
    """(optimizer or None, lr scheduler configs) from ``module.configure_optimizers()``, checked."""
    name = type(module).__name__
    optimizers, schedulers = init_optimizers_and_lr_schedulers(module)
    if len(optimizers) > 1:
        raise NnScalerLightningError(
            f"{name}.configure_optimizers returned {len(optimizers)} optimizers; NnScalerStrategy supports one "
            f"optimizer: return a single optimizer (put every parameter in it)")
    if len(schedulers) > 1:
        raise NnScalerLightningError(
            f"{name}.configure_optimizers returned {len(schedulers)} LR schedulers; NnScalerStrategy supports one "
            f"LR scheduler: combine them (e.g. torch.optim.lr_scheduler.SequentialLR) and return one")
    if not optimizers:
        return None, schedulers
    check_optimizer(optimizers[0], module, f"{name}.configure_optimizers returned")
    return optimizers[0], schedulers


def check_optimizer(opt: torch.optim.Optimizer, module: torch.nn.Module, what: str) -> None:
    """One parameter group over every trainable parameter of `module`; `what` names where the
    optimizer came from (``"Model.configure_optimizers returned"``)."""
    if len(opt.param_groups) != 1:
        raise NnScalerLightningError(
            f"{what} {type(opt).__name__} with {len(opt.param_groups)} parameter "
            f"groups; NnScalerStrategy supports one parameter group: give every parameter the same "
            f"hyper-parameters (one group)")
    given = {id(p) for p in opt.param_groups[0]["params"]}
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in given]
    if missing or len(given) != len(trainable):
        raise NnScalerLightningError(
            f"{what} {type(opt).__name__} over a subset of the trainable parameters "
            f"(missing {', '.join(missing[:5]) or 'none'}{', ...' if len(missing) > 5 else ''}); NnScalerStrategy "
            f"optimizes every trainable parameter: pass self.parameters(), or freeze the others "
            f"(requires_grad_(False)) before training")


def rebuild(opt: torch.optim.Optimizer, pm: torch.nn.Module,
            offload_device: Optional[Union[str, torch.device]] = None) -> torch.optim.Optimizer:
    """`opt` itself, re-pointed at `pm`'s trainable parameters (or this rank's ZeRO shards) and
    given nnscaler's methods (``clip_gnorm``, ...); its state is empty. With `offload_device`
    it steps on fp32 copies there (``nnscaler.runtime.offload_optimizer``: ``cpu_offload=True``). An LR scheduler already
    bound to it keeps working (its step wrapper is re-pointed at the new class's step)."""

    def same_optimizer(params, **_):
        params = list(params)
        if params and isinstance(params[0], dict):  # a rank with nothing to optimize
            params = [p for group in params for p in group["params"]]
        opt.param_groups[0]["params"] = params
        opt.state.clear()
        return opt

    opt = build_optimizer(pm, same_optimizer)
    if offload_device is not None:
        opt = offload_optimizer(opt, offload_device)
    mix_into(opt, ThroughWrappers, "Wrapped")
    return rewrap_scheduler_step(opt)


class ThroughWrappers:
    """Lightning's optimizer wrappers (Fabric's `_FabricOptimizer`, `LightningOptimizer`) take
    the optimizer's class as a base, so its methods run with the *wrapper* as ``self``; Fabric's
    wrapper does not copy the optimizer's attributes (nnscaler's state, `optimizer_state`, finds the
    wrapped optimizer's record, but torch's own state and hooks are the optimizer's):
    ``fabric_opt.zero_grad()`` must clear the parameters' gradients under ZeRO, or they would
    accumulate across steps. Mixed in last, this sends those calls to the optimizer itself."""

    def _nnscaler_inner(self):
        inner = self.__dict__.get("_optimizer")
        return inner if isinstance(inner, torch.optim.Optimizer) and inner is not self else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        inner = self._nnscaler_inner()
        if inner is not None:
            return inner.zero_grad(set_to_none)
        return super().zero_grad(set_to_none)

    @property
    def zero_layout(self):
        inner = self._nnscaler_inner()
        return inner.zero_layout if inner is not None else super().zero_layout
