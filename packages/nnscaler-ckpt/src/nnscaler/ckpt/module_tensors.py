"""What a rank holds of the model: its local tensors and where each sits in its full tensor.

A parallelized module is recognised by the IR contract `GeneratedAttrs` (the generated class's
attributes: ``COMPUTE_CONFIG``, ``GRAPH_FINGERPRINT``, ``PIPELINE``, ``held_tensors``); its tensors are
described by its ``fullmap`` (local name -> ``FullMapEntry``) and ``full_aliases``, which the
runtime's ``ParallelModule`` provides. A fully sharded parameter (``use_zero=3``) is never read
whole: ``held_tensors()`` gives the flat ranges of it this rank's shards hold, saved and loaded as
the rectangular blocks they tile (`held_blocks`), pieces of the same format as a whole local
tensor's, so no rank gathers its local model for a checkpoint. The checkpoint package never imports the runtime. A
container holding parallelized modules contributes its own plain parameters and buffers too,
whole (replicated on every rank). Full names are prefixed with the parallelized module's path in
the container.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from nnscaler.ir.contracts import GeneratedAttrs, HeldRange, flat_blocks

from .errors import CheckpointError
from .records import ModulePlan

__all__ = ["LocalTensor", "parallel_modules", "random_streams", "local_tensors", "plan_identity", "module_plans",
           "piece_key", "held_blocks"]


@dataclass
class LocalTensor:
    """One local tensor. slices / value_split / replicas as in ``FullMapEntry``; `aliases`: other
    full names of the same (tied) tensor. `held`: the flat ranges this rank holds of a tensor it
    does not hold whole (``use_zero=3``'s shards, `GeneratedAttrs.held_tensors`); `tensor` is then a
    ``meta`` tensor of the local shape and dtype, and the rank's pieces are `held_blocks`."""

    full_name: str
    full_shape: Tuple[int, ...]
    slices: Tuple[Tuple[int, int], ...]
    value_split: Tuple[int, int]
    replicas: int
    tensor: torch.Tensor
    persistent: bool
    trainable: bool
    aliases: Tuple[str, ...] = ()
    held: Optional[Tuple[HeldRange, ...]] = None

    @property
    def key(self) -> str:
        return piece_key(self.full_name, self.slices, self.value_split)

    def pieces(self) -> List[Tuple[Tuple[Tuple[int, int], ...], torch.Tensor]]:
        """(region of the full tensor, the tensor holding its values) of every piece this rank
        holds: the whole local tensor, or the rectangular blocks of its held ranges (`held_blocks`)."""
        return [(self.slices, self.tensor)] if self.held is None else list(held_blocks(self))

    def piece_keys(self) -> List[str]:
        return [piece_key(self.full_name, region, self.value_split) for region, _ in self.pieces()]


def held_blocks(lt: "LocalTensor") -> Iterator[Tuple[Tuple[Tuple[int, int], ...], torch.Tensor]]:
    """The held ranges of `lt` as rectangular blocks (`flat_blocks`): (the block's region of the full
    tensor, a view of the held storage in the block's shape). Saved as pieces, they keep the
    format of a whole local tensor's piece; loaded, they are filled in place."""
    shape = tuple(lt.tensor.shape)
    for r in lt.held or ():
        for first, region in flat_blocks(shape, r.start, r.stop):
            dims = tuple(hi - lo for lo, hi in region)
            at = first - r.start
            view = r.values[at:at + math.prod(dims)].view(dims)
            yield tuple((lo + o, hi + o) for (lo, hi), (o, _) in zip(region, lt.slices)), view


def piece_key(full_name: str, slices, value_split) -> str:
    """A name for a piece of a full tensor, equal on every rank holding the same values."""
    return f"{full_name}|{[list(s) for s in slices]}|{list(value_split)}"


def parallel_modules(module: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """(path, module) of every parallelized module (a `GeneratedAttrs`) in `module` (itself included)."""
    found = [(path, m) for path, m in module.named_modules() if isinstance(m, GeneratedAttrs)]
    if not found:
        raise CheckpointError(f"{type(module).__name__} is not a parallelized module and holds none: pass the "
                              f"module nnscaler.parallelize returned")
    return found


def random_streams(module: Optional[torch.nn.Module]) -> Dict[str, torch.nn.Module]:
    """path -> parallelized module, for those with their own random stream (``rng_state()`` /
    ``load_rng_state()``, the runtime's ``RandomStreamsMixin``: the IR contract does not declare
    them, so this is the one capability looked up by name)."""
    if not isinstance(module, torch.nn.Module):
        return {}
    return {path: m for path, m in module.named_modules() if isinstance(m, GeneratedAttrs) and hasattr(m, "rng_state")}


def _prefix(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _full_map(path: str, pm: torch.nn.Module):
    """(``fullmap``, ``full_aliases``) of parallelized module `pm`, which the runtime's
    ``ParallelModule`` holds; a `GeneratedAttrs` without them is refused by name."""
    try:
        return pm.fullmap, pm.full_aliases
    except AttributeError:
        raise CheckpointError(f"{type(pm).__name__} (at {path or 'the top'}) is a generated module without a fullmap "
                              f"and full_aliases: pass the module nnscaler.parallelize returned (a ParallelModule)") \
            from None


def local_tensors(module: torch.nn.Module) -> List[LocalTensor]:
    """Every persistent or non-persistent local tensor of this rank, parallelized ones first."""
    out: List[LocalTensor] = []
    seen = set()
    pms = parallel_modules(module)
    for path, pm in pms:
        persistent = pm.state_dict(keep_vars=True)
        aliases: Dict[str, List[str]] = {}
        fullmap, full_aliases = _full_map(path, pm)
        held = pm.held_tensors() or {}  # fully sharded parameters: never read whole (no gather)
        for full, local in full_aliases.items():
            aliases.setdefault(local, []).append(_prefix(path, full))
        for local, e in fullmap.items():
            h = held.get(local)
            t = getattr(pm, local) if h is None else persistent.get(local, pm._parameters.get(local))
            seen.add(id(t))
            trainable = isinstance(t, torch.nn.Parameter) and t.requires_grad
            if h is not None:
                t = torch.empty(h.shape, dtype=h.dtype, device="meta")
            out.append(LocalTensor(_prefix(path, e.full_name), tuple(e.full_shape), tuple(map(tuple, e.slices)),
                                   tuple(e.value_split), int(e.replicas), t, local in persistent, trainable,
                                   tuple(sorted(aliases.get(local, ()))), None if h is None else tuple(h.ranges)))
    inside = [p for p, _ in pms]
    plain: Dict[int, LocalTensor] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen or any(p == "" or name.startswith(p + ".") for p in inside):
            continue
        if id(t) in plain:
            lt = plain[id(t)]
            lt.aliases = tuple(sorted((*lt.aliases, name)))
            continue
        plain[id(t)] = LocalTensor(name, tuple(t.shape), tuple((0, d) for d in t.shape), (0, 1),
                                   1, t, True, isinstance(t, torch.nn.Parameter) and t.requires_grad)
    out.extend(plain.values())
    return out


def plan_identity(module: torch.nn.Module) -> List[Dict[str, Any]]:
    """`module_plans` as JSON."""
    return [p.to_json() for p in module_plans(module)]


def module_plans(module: torch.nn.Module) -> List[ModulePlan]:
    """Per parallelized module: its path, class, graph fingerprint and compute config (as
    ``ComputeConfig.to_dict()``: the generated class's ``COMPUTE_CONFIG``, typed by `GeneratedAttrs`)."""
    ident = []
    for path, pm in parallel_modules(module):
        ident.append(ModulePlan(path, type(pm).__name__, pm.GRAPH_FINGERPRINT,
                                json.loads(json.dumps(pm.COMPUTE_CONFIG.to_dict(), default=str))))
    return ident
