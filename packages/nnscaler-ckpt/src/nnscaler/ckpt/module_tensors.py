"""What a rank holds of the model: its local tensors and where each sits in its full tensor.

A parallelized module is recognised by the IR contract `GeneratedAttrs` (the generated class's
attributes: ``COMPUTE_CONFIG``, ``GRAPH_FINGERPRINT``, ``PIPELINE``, ``unsharded``); its tensors are
described by its ``fullmap`` (local name -> ``FullMapEntry``) and ``full_aliases``, which the
runtime's ``ParallelModule`` provides. The checkpoint package never imports the runtime. A
container holding parallelized modules contributes its own plain parameters and buffers too,
whole (replicated on every rank). Full names are prefixed with the parallelized module's path in
the container.
"""
from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from nnscaler.ir.contracts import GeneratedAttrs

from .errors import CheckpointError
from .records import ModulePlan

__all__ = ["LocalTensor", "parallel_modules", "random_streams", "local_tensors", "plan_identity", "module_plans",
           "piece_key", "whole_tensors", "with_whole_tensors"]


@dataclass
class LocalTensor:
    """One local tensor. slices / value_split / replicas as in ``FullMapEntry``; `aliases`: other
    full names of the same (tied) tensor."""

    full_name: str
    full_shape: Tuple[int, ...]
    slices: Tuple[Tuple[int, int], ...]
    value_split: Tuple[int, int]
    replicas: int
    tensor: torch.Tensor
    persistent: bool
    trainable: bool
    aliases: Tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return piece_key(self.full_name, self.slices, self.value_split)


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


@contextlib.contextmanager
def whole_tensors(module: torch.nn.Module, writeback: bool = False) -> Iterator[None]:
    """Every parallelized module of `module` holds its whole local tensors inside (the IR contract
    ``GeneratedAttrs.unsharded``: fully sharded parameters are gathered, and with `writeback`
    stored back on exit; nothing happens for other modules). COLLECTIVE where parameters are
    fully sharded."""
    with contextlib.ExitStack() as stack:
        if isinstance(module, torch.nn.Module):
            for _, pm in module.named_modules():
                if isinstance(pm, GeneratedAttrs):
                    stack.enter_context(pm.unsharded(writeback))
        yield


def with_whole_tensors(writeback: bool) -> Callable:
    """Decorator of a function ``fn(path, module, ...)``: runs it inside `whole_tensors`."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(path, module, *args, **kwargs):
            with whole_tensors(module, writeback):
                return fn(path, module, *args, **kwargs)
        return run
    return wrap


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
        persistent = set(pm.state_dict(keep_vars=True))
        aliases: Dict[str, List[str]] = {}
        fullmap, full_aliases = _full_map(path, pm)
        for full, local in full_aliases.items():
            aliases.setdefault(local, []).append(_prefix(path, full))
        for local, e in fullmap.items():
            t = getattr(pm, local)
            seen.add(id(t))
            out.append(LocalTensor(_prefix(path, e.full_name), tuple(e.full_shape), tuple(map(tuple, e.slices)),
                                   tuple(e.value_split), int(e.replicas), t, local in persistent,
                                   isinstance(t, torch.nn.Parameter) and t.requires_grad,
                                   tuple(sorted(aliases.get(local, ())))))
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
