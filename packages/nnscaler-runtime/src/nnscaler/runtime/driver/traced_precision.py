"""The forward traced in ``use_zero=3``'s ``param_dtype`` (``pas_config["zero3_mixed_precision"]``).

The generated code keeps the dtypes its trace saw (transformers' RMSNorm returns
``hidden.to(input_dtype)``), so bf16 weights gathered from fp32 shards would meet fp32 activations
in a program traced in fp32. Generation therefore traces with each parameter in its unit's
``param_dtype`` (its ``.data`` swapped for a cast copy, put back after), then records the
parameters in the graph in the dtype they are stored in: the generated module registers them, the
shards, the weights file and checkpoints in that dtype, and the gathers cast
(`nnscaler.runtime.zero3`). As FSDP2's ``cast_forward_inputs``, each unit's module casts its
floating inputs to its ``param_dtype`` (a forward pre-hook while tracing: the casts become ops of
the generated program), so units of different dtypes meet. The units are found as the runtime
finds them (`contracts.unit_names`, `root_modules`, ``zero3_units``)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, Iterator

import torch

from nnscaler.ir.contracts import ROOT_UNIT, resolve_unit_modules, root_modules, unit_names
from nnscaler.ir.contracts import mixed_precision

__all__ = ["TracePrecision", "check_mixed_precision", "trace_precision", "traced_in", "record_stored_dtypes"]


@dataclass
class TracePrecision:
    """What tracing changes: `params` (name, the first of a tied tensor's -> the dtype forward computes
    it in, where it differs from the stored one) and `inputs` (unit module path -> its ``param_dtype``,
    which its floating inputs are cast to)."""

    params: Dict[str, torch.dtype] = field(default_factory=dict)
    inputs: Dict[str, torch.dtype] = field(default_factory=dict)


def check_mixed_precision(cfg) -> None:
    """Refuse a bad ``zero3_mixed_precision`` (an unknown key or dtype, no ``use_zero=3``) on every rank."""
    mixed_precision(cfg.pas_config.get("zero3_mixed_precision"), cfg.zero_stage, cfg.inference_only)


def trace_precision(module: torch.nn.Module, cfg) -> TracePrecision:
    """The casts tracing `module` under `cfg`'s policy needs (none without one)."""
    policy = mixed_precision(cfg.pas_config.get("zero3_mixed_precision"), cfg.zero_stage, cfg.inference_only)
    out = TracePrecision()
    if not policy.active:
        return out
    names: Dict[int, list] = {}
    params: Dict[str, torch.nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        if len(names[id(p)]) == 1:
            params[name] = p
    tied = {n for group in names.values() if len(group) > 1 for n in group}
    given = cfg.pas_config.get("zero3_units")
    units = []
    if given:
        types = {path: f"{type(m).__module__}.{type(m).__qualname__}" for path, m in module.named_modules()}
        units = resolve_unit_modules(types, given)
    full = list(params)
    edges = root_modules(full, {n: tuple(p.shape) for n, p in params.items()}, units, tied)
    unit_of = unit_names(full, [*units, *edges])
    for name, p in params.items():
        dtype = policy.for_unit(unit_of[name]).param_dtype
        if p.is_floating_point() and dtype is not None and dtype != p.dtype:
            out.params[name] = dtype
        if dtype is not None and unit_of[name] != ROOT_UNIT:
            out.inputs[unit_of[name]] = dtype
    return out


def _cast_inputs(dtype: torch.dtype):
    def cast(x):
        if isinstance(x, torch.Tensor):
            return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
        if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
            return type(x)(cast(v) for v in x)
        if isinstance(x, dict) and type(x) is dict:
            return {k: cast(v) for k, v in x.items()}
        return x

    def hook(_module, args, kwargs):
        return cast(args), cast(kwargs)
    return hook


@contextlib.contextmanager
def traced_in(module: torch.nn.Module, precision: TracePrecision) -> Iterator[None]:
    """Inside, the parameters `precision` names hold a copy in their compute dtype (the same Parameter
    objects) and the unit modules cast their floating inputs; all put back on exit."""
    params = dict(module.named_parameters())
    saved, hooks = [], []
    try:
        with torch.no_grad():
            for name, dtype in precision.params.items():
                p = params[name]
                saved.append((p, p.data))
                p.data = p.data.to(dtype)
        for path, dtype in precision.inputs.items():
            hooks.append(module.get_submodule(path).register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True))
        yield
    finally:
        for h in hooks:
            h.remove()
        for p, data in saved:
            p.data = data


def record_stored_dtypes(graph, module: torch.nn.Module, precision: TracePrecision) -> None:
    """The graph's parameters `precision` cast declared in the dtype the module stores them in (what
    the generated module registers and loads); the values the ops read keep the traced dtype."""
    from nnscaler.ir import dtype_name
    params = dict(module.named_parameters())
    for name in precision.params:
        graph.params[name].dtype = dtype_name(params[name].dtype)
