"""What a rank's optimizer holds, described by full parameter name, and putting a state back.

Without ZeRO, optimizer parameter ``i`` is the ``i``-th trainable parameter of the module
(``build_optimizer``'s contract) and its state tensors have the local tensor's shape. Under ZeRO
(an optimizer ``build_optimizer`` returned is an IR `OptimizerAttrs`; its ``zero_layout``, the
IR's ``ZeroShardLayout``, is not None) parameter ``piece.state_index`` is elements
``[start, stop)`` of the flattened local tensor and its state tensors are 1-D. State tensors of
another shape (Adam's ``step``) are per-parameter values, the same on every piece. fp32 masters
(``state_dict()["master_weights"]``) are kept as the state ``master_weights``.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from nnscaler.ir.contracts import OptimizerAttrs, ZeroShardLayout

from .errors import CheckpointError
from .module_tensors import LocalTensor

__all__ = ["OptimizerSlot", "zero_layout", "optimizer_slots", "optimizer_class", "user_optimizer_class",
           "with_first_step_state", "hyper_parameters", "apply_hyper_parameters",
           "MASTER"]

MASTER = "master_weights"


@dataclass
class OptimizerSlot:
    """Optimizer parameter `index`: elements [start, stop) of local tensor `local` (flat: the
    state tensors are 1-D, else they have the local tensor's shape)."""

    index: int
    local: LocalTensor
    start: int
    stop: int
    flat: bool


def _is_mixin_class(c: type) -> bool:
    b = c.__bases__
    return (len(b) == 2 and not issubclass(b[0], torch.optim.Optimizer)
            and issubclass(b[1], torch.optim.Optimizer))


def user_optimizer_class(optimizer: torch.optim.Optimizer) -> Optional[type]:
    """The user's optimizer class (``torch.optim.Adam``) behind nnscaler's mixins, or None."""
    for c in type(optimizer).__mro__:
        if issubclass(c, torch.optim.Optimizer) and not _is_mixin_class(c):
            return c
    return None


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """The user's optimizer class by name (``torch.optim.adam.Adam``), not nnscaler's wrappers around it."""
    c = user_optimizer_class(optimizer)
    return f"{c.__module__}.{c.__qualname__}" if c is not None else type(optimizer).__qualname__


def zero_layout(optimizer) -> Optional[ZeroShardLayout]:
    """The optimizer's ZeRO layout (the IR contract `OptimizerAttrs`), None when its state is not sharded."""
    return optimizer.zero_layout if isinstance(optimizer, OptimizerAttrs) else None


def optimizer_slots(module: torch.nn.Module, optimizer, tensors: List[LocalTensor]) -> List[OptimizerSlot]:
    """Every optimizer parameter of this rank, by index."""
    layout = zero_layout(optimizer)
    if layout is not None:
        by_place = {(lt.full_name, lt.slices): lt for lt in tensors}
        slots = []
        for p in layout.pieces:
            name = f"{p.module_path}.{p.full_name}" if p.parallel and p.module_path else p.full_name
            lt = by_place.get((name, tuple(map(tuple, p.slices))))
            if lt is None:
                raise CheckpointError(f"ZeRO piece {p.state_index} ({name}{list(p.slices)}) is not a tensor of the "
                                      f"module: pass the module the optimizer was built over")
            slots.append(OptimizerSlot(p.state_index, lt, p.start, p.stop, True))
        return slots
    by_id = {id(lt.tensor): lt for lt in tensors}
    trainable = [p for p in module.parameters() if p.requires_grad]
    held = sum(len(g["params"]) for g in optimizer.param_groups)
    if held != len(trainable):
        raise CheckpointError(f"the optimizer holds {held} parameters, the module {len(trainable)} trainable ones: "
                              f"build the optimizer with nnscaler.build_optimizer(module, ...)")
    return [OptimizerSlot(i, by_id[id(p)], 0, by_id[id(p)].tensor.numel(), False) for i, p in enumerate(trainable)]


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return repr(value)


def hyper_parameters(optimizer) -> List[Dict[str, Any]]:
    """Each param group's settings (lr, betas, ...) as JSON."""
    return [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]


def apply_hyper_parameters(current: List[Dict[str, Any]], saved: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """`current` param groups (from ``state_dict()``) with the saved settings, typed as now."""
    if len(saved) != len(current):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved)} param groups, this one {len(current)}: "
                              f"build the optimizer as it was built when saving")
    out = []
    for now, old in zip(current, saved):
        group = dict(now)
        for k, v in old.items():
            if k not in now:
                group[k] = v
                continue
            cur = now[k]
            if isinstance(cur, tuple):
                v = tuple(v)
            elif isinstance(cur, torch.Tensor):
                v = torch.tensor(v, dtype=cur.dtype, device=cur.device)
            elif isinstance(cur, float) and isinstance(v, str):
                v = float(v)
            group[k] = v
        out.append(group)
    return out


def element_wise(value: torch.Tensor, slot: OptimizerSlot) -> bool:
    """Whether a state tensor holds one value per element of the slot (else: per parameter)."""
    if slot.flat:
        return value.dim() == 1 and value.numel() == slot.stop - slot.start
    return tuple(value.shape) == tuple(slot.local.tensor.shape) and value.dim() > 0


def state_of(optimizer) -> Tuple[Dict[int, Dict[str, Any]], Optional[Dict[int, torch.Tensor]]]:
    sd = optimizer.state_dict()
    return sd["state"], sd.get(MASTER)


_PROBE_NUMEL = 3  # elements of the stand-in parameter: a state tensor of this shape is element-wise


def _first_step_template(cls: type, optimizer, group: Dict[str, Any],
                         like: torch.Tensor) -> Optional[Dict[str, Tuple[bool, Tuple[int, ...], torch.dtype]]]:
    """name -> (element-wise, shape, dtype) of every state tensor the first step of `cls` gives a
    parameter of `like`'s dtype and device under `group`'s settings: one step of a fresh `cls` over
    a zero stand-in with a zero gradient. None when `cls` cannot be built or stepped that way."""
    stand_in = torch.zeros(_PROBE_NUMEL, dtype=like.dtype, device=like.device, requires_grad=True)
    stand_in.grad = torch.zeros_like(stand_in)
    settings = {k: v for k, v in group.items() if k != "params"}
    try:
        accepted = inspect.signature(cls).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
        # the constructor's own arguments among the defaults (AdamW's hold decoupled_weight_decay,
        # which it does not take); the group's settings, all of them, are its param group's
        kwargs = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}
        probe = cls([{**settings, "params": [stand_in]}], **kwargs)
        probe.step()
        state = dict(probe.state.get(stand_in, {}))
    except Exception:  # noqa: BLE001 - not an estimate then: async_save sizes for what there is
        return None
    return {name: (tuple(v.shape) == (_PROBE_NUMEL,), tuple(v.shape), v.dtype)
            for name, v in state.items() if isinstance(v, torch.Tensor)}


def with_first_step_state(optimizer, states: Dict[int, Dict[str, Any]]) -> Dict[int, Dict[str, Any]]:
    """`states` (``state_dict()["state"]``) where every optimizer parameter that holds no state yet
    gets the state tensors the optimizer's first step will give it, as ``meta`` tensors (shape and
    dtype only: for sizing, never written): Adam's ``exp_avg`` / ``exp_avg_sq`` of the parameter's
    shape and dtype and its ``step``. Each kind is found by one step of the user's optimizer class
    (`user_optimizer_class`) over a stand-in of the parameter's dtype and device, with its param
    group's settings; an optimizer class that cannot be built or stepped that way adds nothing."""
    cls = user_optimizer_class(optimizer)
    out = dict(states)
    if cls is None:
        return out
    templates: Dict[Tuple[int, torch.dtype, torch.device], Any] = {}
    index = 0  # state_dict()'s index: the parameters of every group, in order
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if not out.get(index):
                key = (g, p.dtype, p.device)
                if key not in templates:
                    templates[key] = _first_step_template(cls, optimizer, group, p)
                if templates[key]:
                    out[index] = {name: torch.empty(tuple(p.shape) if per_element else shape, dtype=dtype,
                                                    device="meta")
                                  for name, (per_element, shape, dtype) in templates[key].items()}
            index += 1
    return out
