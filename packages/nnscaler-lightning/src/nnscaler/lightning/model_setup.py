"""Turning the LightningModule into its parallel self: tracing input, parallelize, conversion.

After `convert(module, pm, device)`:
- `module.nnscaler_pmodule` is this rank's ParallelModule (a registered submodule, so
  `module.parameters()`, `.train()` / `.eval()` and `.to()` reach it);
- `module.forward` runs the parallel forward (outputs whole on every rank of a unit);
- `module.log` / `log_dict` reduce `sync_dist=True` values over the ranks that hold different
  data (one per data-parallel unit), not over the ranks of a unit, which hold the same value;
- every top-level attribute that held traced parameters or buffers is ``None``;
- a trainable parameter the module held directly, or one the parallel module does not hold, is
  an `OutsideForwardParameter`: using it with grad enabled is an error naming it (param_guard.py).
`forward` and `log` are rewritten as instance attributes, which shadow the class's methods for
this object only (``self(x)`` and Lightning's own calls reach them); the seed asks for both, and
neither torch nor Lightning has a hook that replaces a module's forward or sets the group of
``log``. What `convert` did is a `Conversion`, kept by the strategy.
"""
from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Any, Dict, Tuple

import torch
from torch.utils.data import DataLoader

from .errors import NnScalerLightningError
from .internals import first_dataloader
from .param_guard import guard_direct_parameters, guard_untraced_parameters

__all__ = ["PMODULE_ATTR", "Conversion", "dummy_forward_args", "convert", "pmodule_of", "removed_module_hint"]

PMODULE_ATTR = "nnscaler_pmodule"


def pmodule_of(module: torch.nn.Module):
    pm = getattr(module, PMODULE_ATTR, None)
    if pm is None:
        raise NnScalerLightningError(f"{type(module).__name__} has not been set up by NnScalerStrategy yet "
                                     f"(no {PMODULE_ATTR}): call trainer.fit / validate / test first")
    return pm


def _first_batch(trainer) -> Any:
    """The first batch of the training data (else validation, test, predict), with num_workers=0."""
    loader = first_dataloader(trainer)
    if isinstance(loader, (list, tuple)) and loader:
        loader = loader[0]
    if isinstance(loader, dict) and loader:
        loader = next(iter(loader.values()))
    if loader is None:
        raise NnScalerLightningError(
            "dummy_forward_args_fn needs a batch but the Trainer has no dataloader: pass one to trainer.fit / "
            "validate / test, or give the LightningModule a dummy_forward_args property instead")
    if isinstance(loader, DataLoader) and loader.num_workers:
        loader = DataLoader(loader.dataset, batch_size=loader.batch_size, collate_fn=loader.collate_fn,
                            num_workers=0)
    return next(iter(loader))


def dummy_forward_args(module: torch.nn.Module, trainer, strategy) -> Dict[str, Any]:
    """The tracing input: ``module.dummy_forward_args`` (a dict by forward argument name, shaped
    like one rank's batch) or ``module.dummy_forward_args_fn(first batch)``."""
    name = type(module).__name__
    if hasattr(type(module), "dummy_forward_args") or "dummy_forward_args" in vars(module):
        args = module.dummy_forward_args
        where = f"{name}.dummy_forward_args"
    elif hasattr(module, "dummy_forward_args_fn"):
        fn = module.dummy_forward_args_fn
        if not callable(fn):
            raise NnScalerLightningError(f"{name}.dummy_forward_args_fn must be callable (batch -> dict of forward "
                                         f"arguments by name), got {type(fn).__name__}")
        batch = strategy.batch_to_device(_first_batch(trainer))
        args = fn(batch)
        where = f"{name}.dummy_forward_args_fn(batch)"
    else:
        raise NnScalerLightningError(
            f"NnScalerStrategy traces {name}.forward and needs an example input: add a property "
            f"`dummy_forward_args` returning a dict of forward arguments by name (shaped like one rank's batch), "
            f"or a method `dummy_forward_args_fn(batch)` that turns a training batch into that dict")
    if not isinstance(args, dict):
        raise NnScalerLightningError(f"{where} must be a dict of forward arguments by name, got "
                                     f"{type(args).__name__}")
    return args


def _top_level_names(pm) -> Tuple[str, ...]:
    names = {entry.full_name.split(".")[0] for entry in pm.fullmap.values()}
    names.update(full.split(".")[0] for full in pm.full_aliases)
    return tuple(sorted(names))


@dataclasses.dataclass(frozen=True)
class Conversion:
    """What `convert` did to a LightningModule: `removed`, its top-level attributes now None (the
    traced modules; `removed_module_hint` names them); `guarded`, those that held a trainable
    parameter directly and now hold an `OutsideForwardParameter`."""
    removed: Tuple[str, ...]
    guarded: Tuple[str, ...]


def convert(module: torch.nn.Module, pm: torch.nn.Module, device: torch.device) -> Conversion:
    """Put `pm` into `module`, rewrite forward and log, move `module` to `device` and guard the
    parameters used outside forward (see the module docstring)."""
    removed = [n for n in _top_level_names(pm) if n != PMODULE_ATTR and hasattr(module, n)]
    own = dict(module.named_parameters(recurse=False, remove_duplicate=False))
    direct: Dict[str, torch.nn.Parameter] = {n: own[n] for n in removed if n in own and own[n].requires_grad}
    for attr in removed:
        setattr(module, attr, None)
    setattr(module, PMODULE_ATTR, pm)
    _rewrite_forward_and_log(module, pm.grid.sync_group)
    module.to(device)
    guarded = guard_direct_parameters(module, direct, pm, type(module).__name__)
    guard_untraced_parameters(module, removed, type(module).__name__)
    return Conversion(tuple(n for n in removed if n not in guarded), tuple(guarded))


def _rewrite_forward_and_log(module: torch.nn.Module, group) -> None:
    """``module.forward`` runs the parallel module; ``module.log(..., sync_dist=True)`` without a
    ``sync_dist_group`` reduces over `group` (one rank per data-parallel unit: the ranks that see
    different data). `log_dict` calls `log`."""

    def forward(self, *args, **kwargs):
        return getattr(self, PMODULE_ATTR)(*args, **kwargs)

    original_log = module.log

    def log(self, *args, **kwargs):
        if kwargs.get("sync_dist") and kwargs.get("sync_dist_group") is None:
            kwargs["sync_dist_group"] = group
        return original_log(*args, **kwargs)

    module.forward = types.MethodType(forward, module)
    module.log = types.MethodType(log, module)


@contextlib.contextmanager
def removed_module_hint(module, conversion: "Conversion | None", hook: str):
    """Turn the TypeError / AttributeError of using a traced module (now None) outside forward
    into an error naming the attribute and the rule."""
    try:
        yield
    except (TypeError, AttributeError) as exc:
        removed = conversion.removed if conversion is not None else ()
        if not removed or "NoneType" not in str(exc):
            raise
        names = ", ".join(f"self.{n}" for n in removed)
        raise NnScalerLightningError(
            f"{type(module).__name__}.{hook} failed with {type(exc).__name__}: {exc} -- after NnScalerStrategy "
            f"parallelized {type(module).__name__}, {names} {'is' if len(removed) == 1 else 'are'} None: the "
            f"traced modules run only inside forward. Call self(...) (forward) instead, or move that use into "
            f"forward") from exc
