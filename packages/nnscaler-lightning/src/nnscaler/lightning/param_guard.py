"""Rule 1 of the LightningModule: trainable parameters are used only inside ``forward``.

After conversion the traced submodules are None (model_setup.py). A trainable parameter held
directly by the LightningModule (``self.temperature = nn.Parameter(...)``) is replaced by an
`OutsideForwardParameter` instead:
- where the plan keeps it whole on this rank, the guard shares the parallel module's storage, so
  under ``torch.no_grad()`` it reads the trained value (e.g. for logging);
- used with grad enabled it raises an error naming the attribute (its gradient would never reach
  the optimizer); where the plan splits it, any use outside forward raises;
- under fully sharded data parallelism (``ComputeConfig(use_zero=3)``) the parallel module keeps
  only this rank's shard of it (its registered parameter holds no storage outside forward), so
  any use outside forward raises too, naming use_zero=3.
A trainable parameter the parallel module does not hold at all is guarded the same way.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from .errors import NnScalerLightningError

__all__ = ["OutsideForwardParameter", "guard_direct_parameters", "guard_untraced_parameters"]


def _tracks_grad(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(_tracks_grad(v) for v in value)
    return False


class OutsideForwardParameter(torch.nn.Parameter):
    """A trainable parameter the traced forward does not use (see the module docstring)."""

    _nnscaler_where = "?"
    _nnscaler_partitioned = False
    _nnscaler_split_reason = "the plan splits it over the ranks (this rank holds a piece)"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        guards = [a for a in list(args) + list(kwargs.values()) if isinstance(a, OutsideForwardParameter)]
        split = next((g for g in guards if g._nnscaler_partitioned), None)
        if split is not None and func not in _METADATA:
            raise NnScalerLightningError(
                f"{split._nnscaler_where} is used outside forward, but {split._nnscaler_split_reason}: use it "
                f"inside forward only")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if torch.is_grad_enabled() and _tracks_grad(out):
            where = guards[0]._nnscaler_where if guards else cls._nnscaler_where
            raise NnScalerLightningError(
                f"{where} is a trainable parameter used outside forward with grad enabled: NnScalerStrategy "
                f"trains only what the traced forward computes, so its gradient would never be applied. Use it "
                f"inside forward, use it under torch.no_grad(), or freeze it (requires_grad_(False)) before "
                f"training")
        return out


_METADATA = {torch.Tensor.__repr__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
             torch.Tensor.requires_grad.__get__, torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__,
             torch.Tensor.device.__get__, torch.Tensor.is_meta.__get__,
             torch.Tensor.grad_fn.__get__, torch.Tensor.is_leaf.__get__}  # read by Module.__setattr__ (the guard's own)


FULLY_SHARDED_REASON = ("ComputeConfig(use_zero=3) shards it over the data-parallel ranks (this rank keeps a shard "
                        "of it, gathered only inside forward)")


def _guard(value: torch.Tensor, where: str, partitioned: bool, reason: str = "") -> OutsideForwardParameter:
    guard = OutsideForwardParameter(value, requires_grad=True)
    guard._nnscaler_where = where
    guard._nnscaler_partitioned = partitioned
    if reason:
        guard._nnscaler_split_reason = reason
    return guard


def guard_direct_parameters(module: torch.nn.Module, direct: Dict[str, torch.nn.Parameter], pm,
                            owner: str) -> List[str]:
    """Put guards (see the module docstring) where `module` held the traced trainable parameters
    `direct` (by attribute; the caller set those attributes to None); returns the names guarded."""
    local = dict(pm.named_parameters())
    by_full = {e.full_name: (n, e) for n, e in pm.fullmap.items() if n in local}
    # use_zero=3: the parameters give up their storage when sharded, so no guard may share it
    sharded = getattr(pm, "fully_sharded", None) is not None
    done = []
    for name, original in direct.items():
        hit = by_full.get(name)
        whole = hit is not None and tuple(local[hit[0]].shape) == tuple(hit[1].full_shape) \
            and tuple(hit[1].value_split)[1:] in ((), (1,)) and not sharded
        value = local[hit[0]].detach() if whole else original.detach()
        setattr(module, name, _guard(value, f"{owner}.{name}", partitioned=not whole,
                                     reason=FULLY_SHARDED_REASON if sharded and hit is not None else ""))
        done.append(name)
    return done


def guard_untraced_parameters(module: torch.nn.Module, traced_names: Sequence[str], owner: str) -> List[str]:
    """Replace `module`'s trainable parameters whose names are not under `traced_names` (top-level
    attributes, already None) by guards; returns their names."""
    guarded = []
    for name, p in list(module.named_parameters()):
        if not p.requires_grad or name.split(".")[0] in traced_names or name.startswith("nnscaler_pmodule."):
            continue
        parent = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        setattr(parent, name.rpartition(".")[2], _guard(p.detach(), f"{owner}.{name}", partitioned=False))
        guarded.append(name)
    return guarded
