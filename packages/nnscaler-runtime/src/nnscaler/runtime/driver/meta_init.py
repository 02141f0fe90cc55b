"""Values for a ParallelModule made from a module built on the meta device.

`parallelize()` accepts a module built under ``with torch.device("meta")``: nothing of it holds
memory, each rank allocates only its own local tensors, and the values come from either

- `nnscaler.ckpt.load` (a checkpoint or a Hugging Face directory), or
- the module's own initialisation, run here on every rank (`fill_from_init`): each module's
  ``reset_parameters()`` (torch's layers) and, inside a transformers ``PreTrainedModel``, its
  ``_init_weights``, replayed in the order building the module on the CPU runs them (post-order:
  a layer resets when it is built, a ``PreTrainedModel`` initialises its sub-tree at the end of
  its ``__init__``, skipping what a nested one already did), from rank 0's torch generator as it
  was when `parallelize` was called. So with the same seed the values are those of the module
  built on the CPU (in the dtypes the meta module has: a draw in float64 is not a float32 draw
  cast). One module's own tensors are materialized at a time (on the CPU, then copied
  into the slices this rank holds, `write_full`, and dropped), so a rank never holds more than one
  module beyond its local tensors; under ``use_zero=3`` those are its shards (the generated module
  is built on meta and sharded at once: `ParallelModule._post_init`).

Non-persistent buffers (a rotary embedding's ``inv_freq``) are in no checkpoint: they are always
filled from the initialisation (`fill_from_init(..., buffers_only=True)`).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..errors import ConfigError

__all__ = ["has_meta_tensors", "check_initializable", "fill_from_init", "initial_values", "write_full"]


def has_meta_tensors(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _pretrained_class():
    tf = sys.modules.get("transformers")  # a PreTrainedModel exists only if transformers was imported
    return getattr(tf, "PreTrainedModel", None) if tf is not None else None


def _own_meta(module: torch.nn.Module, buffers_only: bool) -> List[str]:
    names = [] if buffers_only else [n for n, p in module._parameters.items() if p is not None and p.is_meta]
    return names + [n for n, b in module._buffers.items() if b is not None and b.is_meta
                    and (not buffers_only or n in module._non_persistent_buffers_set)]


def _steps(root: torch.nn.Module) -> List[Tuple[str, torch.nn.Module, Optional[torch.nn.Module]]]:
    """(path, module, owner) in the order building `root` on the CPU initialises them: owner None
    runs ``module.reset_parameters()``, otherwise ``owner._init_weights(module)``."""
    pretrained = _pretrained_class()
    out: List[Tuple[str, torch.nn.Module, Optional[torch.nn.Module]]] = []
    done = set()

    def hf_pass(path: str, m: torch.nn.Module, owner: torch.nn.Module) -> None:
        for name, child in m.named_children():  # smart_apply: children first, a nested model dispatches its own
            sub_owner = child if pretrained is not None and isinstance(child, pretrained) else owner
            hf_pass(f"{path}.{name}" if path else name, child, sub_owner)
        if id(m) not in done:
            done.add(id(m))
            out.append((path, m, owner))

    def build(path: str, m: torch.nn.Module) -> None:
        for name, child in m.named_children():
            build(f"{path}.{name}" if path else name, child)
        if callable(getattr(m, "reset_parameters", None)) and (m._parameters or m._buffers):
            out.append((path, m, None))  # what the layer's __init__ did
        if pretrained is not None and isinstance(m, pretrained):
            hf_pass(path, m, m)  # its post_init
    build("", root)
    return out


def check_initializable(root: torch.nn.Module, buffers_only: bool) -> None:
    """Refuse (the same on every rank) a meta tensor that no initialisation step would fill."""
    covered = {id(m) for _, m, _ in _steps(root)}
    for path, m in root.named_modules():
        left = _own_meta(m, buffers_only)
        if left and id(m) not in covered:
            where = path or "the model"
            what = "non-persistent buffer(s)" if buffers_only else "tensor(s)"
            fix = ("no checkpoint holds a non-persistent buffer: build this module on the CPU, or make the buffer "
                   "persistent and load it with nnscaler.ckpt.load") if buffers_only else \
                ("give it a reset_parameters(), build it on the CPU, or pass init_module_params=False and fill the "
                 "values with nnscaler.ckpt.load(path, parallel_module)")
            raise ConfigError(f"{where} ({type(m).__name__}) holds the {what} {', '.join(left)} on the meta device "
                              f"and nnscaler cannot initialize them on the rank (no reset_parameters(), not inside "
                              f"a transformers PreTrainedModel): {fix}")


@contextlib.contextmanager
def _materialized(module: torch.nn.Module, names: List[str]) -> Iterator[Dict[str, torch.Tensor]]:
    """`module`'s own meta tensors `names` replaced by CPU tensors for a while (ties elsewhere and
    the module itself are left as they were)."""
    saved, made = {}, {}
    for n in names:
        slot = module._parameters if n in module._parameters else module._buffers
        old = slot[n]
        new = torch.empty(old.shape, dtype=old.dtype, device="cpu")
        if isinstance(old, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=old.requires_grad)
        saved[n], made[n] = (slot, old), new
        slot[n] = new
    try:
        yield made
    finally:
        for n, (slot, old) in saved.items():
            slot[n] = old


def _rank0_rng_state(state: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [state]
        dist.broadcast_object_list(box, src=0)  # collective: every rank fills from the same stream
        return box[0]
    return state


def fill_from_init(pm, root: torch.nn.Module, rng_state: torch.Tensor, buffers_only: bool = False) -> None:
    """Fill `pm` (the ParallelModule of `root`) from `root`'s initialisation, one module at a time.
    `rng_state`: torch's generator state when `parallelize` was called (rank 0's is used; torch's
    generator is left where building the module on the CPU leaves it). COLLECTIVE unless
    `buffers_only` (no random draw then)."""
    check_initializable(root, buffers_only)
    canonical = {e.full_name for e in pm.fullmap.values()}  # a tied tensor takes its first name's value
    if not buffers_only:
        torch.set_rng_state(_rank0_rng_state(rng_state))
    for values in initial_values(root, buffers_only):
        write_full(pm, {n: t for n, t in values.items() if n in canonical})


def initial_values(root: torch.nn.Module, buffers_only: bool = False) -> Iterator[Dict[str, torch.Tensor]]:
    """`root`'s meta tensors' initial values, one module's own at a time ({full name: CPU tensor},
    valid until the next one), drawn from torch's generator as it is now, in the order building
    `root` on the CPU draws them. `fill_from_init` writes them into a ParallelModule."""
    for path, m, owner in _steps(root):
        names = _own_meta(m, buffers_only)
        if not names:  # nothing of it on the meta device (a real tensor of the user's is left alone)
            continue
        with _materialized(m, names) as made, torch.no_grad():
            if owner is None:
                m.reset_parameters()
            else:
                owner._init_weights(m)
            yield {f"{path}.{n}" if path else n: t for n, t in made.items()}


def write_full(pm, values: Dict[str, torch.Tensor]) -> None:
    """Put full (single-device) tensors by canonical full name into the slices `pm` holds: into a
    fully sharded parameter's held ranges in place (`held_tensors`, no gather), into any other
    local tensor directly. Names `pm` does not hold are skipped."""
    if not values:
        return
    held = pm.held_tensors() or {}
    by_full = {e.full_name: (local, e) for local, e in pm.fullmap.items()}
    with torch.no_grad():
        for name, value in values.items():
            if name not in by_full:
                continue
            local, e = by_full[name]
            if tuple(value.shape) != tuple(e.full_shape):
                raise ConfigError(f"{name} has shape {tuple(value.shape)}, the generated module expects "
                                  f"{tuple(e.full_shape)}: regenerate the code (reuse='override')")
            part = value[tuple(slice(a, b) for a, b in e.slices)]
            if e.value_split[0] != 0:  # the value lives in part 0, the other parts hold zeros
                part = torch.zeros_like(part)
            h = held.get(local)
            if h is None:
                getattr(pm, local).copy_(part)
                continue
            flat = part.reshape(-1)
            for r in h.ranges:
                r.values.copy_(flat[r.start:r.stop])
