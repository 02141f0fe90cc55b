"""The one owner of what nnscaler keeps about an optimizer and about a module.

`build_optimizer`, `with_master_weights` and `offload_optimizer` used to stamp
private attributes on the torch objects they were given. Their state now lives here, in typed
records the runtime owns, found through `optimizer_state(opt)` and `module_state(module)`: the
torch objects carry nothing of ours except the mixed-in class that adds the methods
(`nnscaler.runtime.class_mixin`). Lightning and the Trainer read these records through the same
two functions. The registries hold the torch objects weakly: a record lives as long as its
object."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["OptimizerState", "MasterCopies", "OffloadCopies", "ModuleState", "optimizer_state", "module_state"]


@dataclass
class MasterCopies:
    """fp32 master weights (`nnscaler.runtime.precision.with_master_weights`): (model tensor, its
    master) for every fp16/bf16 tensor the optimizer holds; whether the masters' gradients are set
    for the coming step."""

    pairs: List[Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    grads_ready: bool = False


@dataclass
class OffloadCopies:
    """Optimizer offload (`nnscaler.runtime.offload.offload_optimizer`): `pairs` (the tensor the
    optimizer was built over, its fp32 copy on `device`); `reads`: where each copy is refreshed
    from (a tensor and an optional flat range of it); `versions`: their version counters when the
    copies last matched them."""

    device: torch.device
    pairs: List[Tuple[torch.Tensor, torch.Tensor]]
    reads: List[Tuple[torch.Tensor, Optional[Tuple[int, int]]]]
    versions: List[int]


@dataclass
class OptimizerState:
    """What nnscaler keeps for one optimizer.

    module, grid: what `build_optimizer` was given and its rank grid (None for an optimizer that
    did not come from it, e.g. one `with_master_weights` was applied to directly); replicas: id of
    a tensor the optimizer holds -> plan devices holding a copy (the gradient-norm weights); zero:
    the ZeRO engine (`nnscaler.runtime.zero.ZeroEngine`, or the fully sharded
    `FullyShardedOptimizerState` under use_zero=3), None without ZeRO; masters, offload: as above."""

    module: Optional[torch.nn.Module] = None
    grid: Any = None
    replicas: Dict[int, int] = field(default_factory=dict)
    zero: Any = None
    masters: Optional[MasterCopies] = None
    offload: Optional[OffloadCopies] = None


@dataclass
class ModuleState:
    """What nnscaler keeps for one module: the Reducer of a container's plain (not parallelized)
    parameters that `build_optimizer` made. (The precision `apply_precision` installs travels in
    its forward hooks: `nnscaler.runtime.precision.get_precision`.)"""

    plain_reducer: Any = None


_OPTIMIZERS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, OptimizerState]" = weakref.WeakKeyDictionary()
_MODULES: "weakref.WeakKeyDictionary[torch.nn.Module, ModuleState]" = weakref.WeakKeyDictionary()


def optimizer_state(optimizer: torch.optim.Optimizer, create: bool = False) -> Optional[OptimizerState]:
    """nnscaler's record of `optimizer` (None when there is none and not `create`). A wrapper that
    holds the optimizer as ``_optimizer`` and takes its class as a base (Lightning's
    `LightningOptimizer`, Fabric's `_FabricOptimizer`: our methods then run with the wrapper as
    ``self``) finds the wrapped optimizer's record."""
    state = _OPTIMIZERS.get(optimizer)
    if state is None and not create:
        inner = getattr(optimizer, "__dict__", {}).get("_optimizer")
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
            return _OPTIMIZERS.get(inner)
    if state is None and create:
        state = _OPTIMIZERS[optimizer] = OptimizerState()
    return state


def module_state(module: torch.nn.Module, create: bool = False) -> Optional[ModuleState]:
    """nnscaler's record of `module` (None when there is none and not `create`)."""
    state = _MODULES.get(module)
    if state is None and create:
        state = _MODULES[module] = ModuleState()
    return state
