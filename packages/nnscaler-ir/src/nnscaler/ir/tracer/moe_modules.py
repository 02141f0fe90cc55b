"""transformers' experts modules, traced as one `routed_experts` op (``nnscaler.ir.ops.moe``).

transformers marks its experts classes (Mixtral, Qwen2/3-MoE, DeepSeek-V3, gpt-oss, ...) with
``use_experts_implementation``: a forward that dispatches on ``config._experts_implementation``
("eager" loops over the experts that received tokens, a data-dependent Python loop; "grouped_mm"
and "batched_mm" call kernels without a float64 CPU version). Whatever it names, the trace records
one op instead: for the duration of the trace each such module's ``forward`` becomes a call of
`routed_experts` on its own weights (`experts_recorded_whole`). The activation and the gate are
read off the module and checked numerically on a probe against its own ``act_fn`` /
``_apply_gate``; one the op cannot express stops the trace naming the module and the fix.
`set_capacity_factor` gives the op a capacity (token dropping) for every experts module of a model.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Dict, Iterator, Tuple

import torch

from ..errors import ConfigError, TraceError
from ..ops.moe import ACTIVATIONS, ExpertMLP, routed_experts

__all__ = ["is_transformers_experts", "experts_recorded_whole", "experts_spec", "set_capacity_factor",
           "UNKNOWN_EXPERTS_FIX"]

_CAPACITY = "_nnscaler_capacity_factor"  # set on an experts module by `set_capacity_factor`

UNKNOWN_EXPERTS_FIX = ("call nnscaler.routed_experts(hidden, top_k_index, top_k_weights, gate_up, down, ...) in "
                       "the module's forward (docs/moe.md \"Your own MoE module\")")


def is_transformers_experts(module: torch.nn.Module) -> bool:
    """A module of a class transformers' ``use_experts_implementation`` decorated."""
    forward = getattr(type(module), "forward", None)
    return (hasattr(module, "_is_expert_parallel") and hasattr(module, "has_gate")
            and hasattr(module, "is_transposed") and hasattr(forward, "__wrapped__"))


def experts_spec(path: str, module: torch.nn.Module) -> Dict:
    """The keyword arguments of `routed_experts` that reproduce `module` (TraceError when none do)."""
    where = f"experts module {path or '<root>'} ({type(module).__qualname__})"
    if getattr(module, "has_post_expert_norm", False):
        raise TraceError(f"{where} normalises each expert's output (has_post_expert_norm), which "
                         f"nnscaler.routed_experts does not do; {UNKNOWN_EXPERTS_FIX}")
    activation = _activation(where, module)
    transposed = bool(module.is_transposed)
    own_gate = getattr(type(module), "_apply_gate", None)
    if not module.has_gate:
        gate, alpha, limit = "none", 1.0, 0.0
    elif getattr(own_gate, "__name__", "") == "_default_apply_gate":
        gate, alpha, limit = "glu", 1.0, 0.0
    else:
        gate, alpha, limit = "clamped_swiglu", float(getattr(module, "alpha", 1.0)), float(getattr(module, "limit", 0.0))
    spec = dict(activation=activation, gate=gate, transposed=transposed, alpha=alpha, limit=limit)
    if getattr(module, _CAPACITY, None) is not None:
        spec["capacity_factor"] = getattr(module, _CAPACITY)
    if module.has_gate:
        probe = torch.linspace(-9.0, 9.0, 24, dtype=torch.float64).reshape(2, 12)
        mlp = ExpertMLP(activation, gate, transposed, alpha, limit)
        with torch.no_grad():
            want, got = module._apply_gate(probe), mlp.gated(probe)
        if want.shape != got.shape or not torch.allclose(want, got, rtol=1e-9, atol=1e-9):
            raise TraceError(f"{where}: its _apply_gate is none of the gates nnscaler.routed_experts knows "
                             f"(glu, clamped_swiglu); {UNKNOWN_EXPERTS_FIX}")
    return spec


def set_capacity_factor(root: torch.nn.Module, capacity_factor) -> int:
    """Every transformers experts module under `root` drops tokens beyond `capacity_factor` (the
    `routed_experts` argument; None: dropless) when traced, or run inside `experts_recorded_whole`.
    Returns the number of experts modules (0: `root` has none). A factor that is not a number > 0
    is refused here, naming the call, not later when the model is traced."""
    if capacity_factor is not None and (isinstance(capacity_factor, bool) or
                                        not isinstance(capacity_factor, (int, float)) or not capacity_factor > 0):
        raise ConfigError(f"nnscaler.ir.set_capacity_factor(model, {capacity_factor!r}): the capacity factor must be "
                          f"a number > 0 (each expert keeps at most ceil(capacity_factor * tokens * top-k / "
                          f"experts) token slots; e.g. 1.25), or None for dropless routing")
    found = [m for _, m in _found(root)]
    for module in found:
        setattr(module, _CAPACITY, capacity_factor)
    return len(found)


def _activation(where: str, module) -> str:
    act = getattr(module, "act_fn", None)
    config = getattr(module, "config", None)
    named = getattr(config, "hidden_act", None)
    if act is None:
        if named in ACTIVATIONS:
            return named
        raise TraceError(f"{where} has no act_fn; {UNKNOWN_EXPERTS_FIX}")
    probe = torch.linspace(-6.0, 6.0, 25, dtype=torch.float64)
    with torch.no_grad():
        want = act(probe)
        names = ([named] if named in ACTIVATIONS else []) + sorted(ACTIVATIONS)
        for name in names:
            if torch.allclose(ACTIVATIONS[name](probe), want, rtol=1e-9, atol=1e-12):
                return name
    raise TraceError(f"{where}: its activation {type(act).__name__} is none of {sorted(ACTIVATIONS)}; "
                     f"{UNKNOWN_EXPERTS_FIX}")


def _weights(module) -> Tuple:
    up = module.gate_up_proj if module.has_gate else module.up_proj
    up_bias = down_bias = None
    if getattr(module, "has_bias", False):
        up_bias = module.gate_up_proj_bias if module.has_gate else module.up_proj_bias
        down_bias = module.down_proj_bias
    return up, module.down_proj, up_bias, down_bias


def _as_op(module, spec: Dict):
    params = list(inspect.signature(type(module).forward.__wrapped__).parameters)[1:4]

    def forward(*args, **kwargs):
        bound = dict(zip(params, args))
        bound.update(kwargs)
        hidden, index, weights = (bound.get(p) for p in params)
        up, down, up_bias, down_bias = _weights(module)
        return routed_experts(hidden, index, weights, up, down, up_bias, down_bias, **spec)
    return forward


def _found(root: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module]]:
    for path, module in root.named_modules():
        if is_transformers_experts(module):
            yield path, module


@contextlib.contextmanager
def experts_recorded_whole(root: torch.nn.Module):
    """For the block's duration every transformers experts module under `root` calls `routed_experts`."""
    patched = [(m, m.__dict__.get("forward")) for _, m in _found(root)]
    specs = {id(m): experts_spec(p, m) for p, m in _found(root)}
    try:
        for module, _ in patched:
            module.__dict__["forward"] = _as_op(module, specs[id(module)])
        yield [p for p, _ in _found(root)]
    finally:
        for module, old in patched:
            if old is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = old
