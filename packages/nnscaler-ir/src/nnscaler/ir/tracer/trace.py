"""`trace(module, dummy_forward_args)`: run the forward once and record it as an IRGraph.

The front end is a concrete tracer built on ``torch.overrides.TorchFunctionMode``: the user's
forward runs for real (on the device the trace strategy picks) while every torch-level call
(``F.linear``, ``Tensor.view``, ``x + y``...) is recorded with its inputs, outputs, module path
and source line. Python control flow therefore runs on real values: branches on shapes and
constants trace (the taken path is recorded). Why this front end and not torch.fx or
torch.export is written down in docs/architecture.md.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Any, Dict, Optional

import torch

from . import tracing_context
from ..errors import TraceError, TracingWarning
from ..graph import IRGraph, InputSpec, TensorSpec, dtype_name, encode, iter_refs
from .branches import decisions_of, merge_branches
from .moe_modules import experts_recorded_whole
from .kept_functions import keep_functions
from .guards import is_guard, warn_guards
from .example_inputs import check_trace_inputs
from .modes import annotate_modes, mode_name
from .python_randomness import watch_python_randomness
from .recorder import Tracer
from .replay import CallResults
from .trace_device import ExecutionDevice
from .trace_state import SavedState, buffer_updates_of, warn_module_hooks
from ..tree import iter_tensors as _tensors
from ..user_code import warn_user

__all__ = ["trace", "Tracer"]


def _input_leaves(tracer: Tracer, obj, path: tuple, hint: str, leaves: list):
    """Bind every tensor in a (nested) forward argument to a graph input value."""
    if isinstance(obj, torch.Tensor):
        ref = tracer.new_value(obj, hint)
        leaves.append((path, ref))
        twin = tracer.device.input_twin(obj)
        if tracer.is_bound(twin):  # one tensor given twice ({"input_ids": ids, "labels": ids}), or a weight
            twin = _distinct_copy(twin)  # each input its own value: else every use reads the last binding
        tracer.bind_tensor(twin, ref)
        return twin
    if isinstance(obj, dict):
        return type(obj)((k, _input_leaves(tracer, v, path + (k,), f"{hint}_{k}", leaves)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        items = [_input_leaves(tracer, v, path + (i,), f"{hint}_{i}", leaves) for i, v in enumerate(obj)]
        if hasattr(obj, "_fields"):  # namedtuple: indexable by position like a tuple
            return type(obj)(*items)
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _distinct_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` that is another object (so it binds to another graph input)."""
    copy = t.detach().clone()
    return copy.requires_grad_(True) if t.requires_grad and copy.is_floating_point() else copy


def trace(module: torch.nn.Module, dummy_forward_args: Dict[str, Any], *, constant_folding: bool = False,
          trace_strategy: str = "cpu", both_modes: bool = True, both_branches: bool = True,
          replay: bool = True) -> IRGraph:
    """Run `module.forward(**dummy_forward_args)` and record it as an IRGraph.

    `dummy_forward_args` maps forward parameter names to example values (tensors, nested
    dicts/lists of tensors, or constants); parameters left out use their defaults. The module's
    weights, buffers, training flags and the global RNG state are left as they were.

    The graph is the forward in the module's current mode (``module.training``). With
    `both_modes` the forward also runs in the other mode, and the graph records what differs
    (see nnscaler.ir.tracer.modes), so the generated code follows ``.train()`` / ``.eval()``.

    A Python decision on a tensor's value (``if mask.all():``) becomes a guard (nnscaler.ir.tracer.guards);
    with `both_branches` the forward also runs with such a boolean decision flipped, and where the
    two traces line up both branches are kept, chosen at run time (nnscaler.ir.tracer.branches).

    With `replay` those later runs take the first run's result of every call that cannot differ
    instead of running it again (nnscaler.ir.tracer.replay): the same graph, in a fraction of the
    time; ``replay=False`` runs every call (the reference the tests and bench/compile_time.py use).
    """
    check_trace_inputs(module, dummy_forward_args)  # NumPy inputs, quantized/sparse tensors: named refusals
    # later traces (the other mode, flipped decisions) take the calls they share with this one
    first = CallResults() if replay and (both_modes or both_branches) else None
    graph = _trace_once(module, dummy_forward_args, constant_folding, trace_strategy, results=first)
    graph.traced_training = module.training
    if both_modes:
        flags = [(m, m.training) for m in module.modules()]
        module.train(not module.training)
        try:
            with warnings.catch_warnings():  # the first trace has said it all
                warnings.simplefilter("ignore")
                other = _trace_once(module, dummy_forward_args, constant_folding, trace_strategy,
                                    results=first and first.next_trace())
        except Exception as exc:  # the other mode cannot even run: remember where, as a divergence
            graph.mode_divergence = (f"the forward fails in {mode_name(not graph.traced_training)} mode "
                                     f"({type(exc).__name__}: {exc})")
        else:
            annotate_modes(graph, other, graph.traced_training)
        finally:
            for m, flag in flags:
                m.training = flag
    if both_branches and decisions_of(graph):
        def retrace(flips):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return _trace_once(module, dummy_forward_args, constant_folding, trace_strategy, flips,
                                   first and first.next_trace())
        merge_branches(graph, retrace)
    warn_guards(graph)
    return graph


def _trace_once(module: torch.nn.Module, dummy_forward_args: Dict[str, Any], constant_folding: bool,
                trace_strategy: str, flips=frozenset(), results: Optional[CallResults] = None) -> IRGraph:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"trace() needs a torch.nn.Module instance, got {type(module).__name__}")
    if not isinstance(dummy_forward_args, dict):
        raise TypeError("dummy_forward_args must be a dict mapping forward parameter names to example "
                        f"values, got {type(dummy_forward_args).__name__}")
    signature = inspect.signature(module.forward)
    unknown = set(dummy_forward_args) - set(signature.parameters)
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        raise TypeError(f"dummy_forward_args has {sorted(unknown)}, which {type(module).__qualname__}.forward"
                        f" does not take; its parameters are {list(signature.parameters)}")
    for pname, param in signature.parameters.items():
        if param.kind is param.VAR_POSITIONAL and pname in dummy_forward_args:
            raise TypeError(f"dummy_forward_args cannot give {pname!r}, the *{pname} parameter of "
                            f"{type(module).__qualname__}.forward: arguments are passed by name; "
                            f"give the forward named parameters instead")
    device = ExecutionDevice.for_strategy(trace_strategy)
    if not device.runs_in_place:  # the forward sees per-trace copies: nothing to take from another trace
        results = None
    tracer = Tracer(module, constant_folding, device, flips, results)

    by_id: Dict[int, TensorSpec] = {}
    persistent = set(module.state_dict().keys())

    def bind_named(named) -> Dict[str, TensorSpec]:
        """One spec per tensor; later names of the same tensor (tied weights) become aliases."""
        specs: Dict[str, TensorSpec] = {}
        for name, t in named:
            if id(t) in by_id:
                by_id[id(t)].aliases.append(name)
                continue
            ref = tracer.new_value(t, name.replace(".", "_"))
            tracer.param_names[ref.id] = name
            tracer.bind_tensor(t, ref)
            is_param = isinstance(t, torch.nn.Parameter)
            by_id[id(t)] = specs[name] = TensorSpec(name, ref, tuple(t.shape), dtype_name(t.dtype),
                                                    t.requires_grad and is_param, [], is_param or name in persistent)
        return specs

    params = bind_named(module.named_parameters(remove_duplicate=False))
    device.mark_weights(t for _, t in module.named_parameters())
    buffers = bind_named(module.named_buffers(remove_duplicate=False))
    if results is not None:  # put back after every trace (trace_state.SavedState)
        results.start((t for named in (module.named_parameters(), module.named_buffers()) for _, t in named), True)

    inputs, call_kwargs = [], {}
    for pname, param in signature.parameters.items():
        if param.kind is param.VAR_KEYWORD:  # names forward does not list go to **kwargs (keyword-only)
            for extra in (n for n in dummy_forward_args if n in unknown):
                spec = InputSpec(extra, "KEYWORD_ONLY", False, None, True)
                call_kwargs[extra] = _input_leaves(tracer, dummy_forward_args[extra], (), extra, spec.leaves)
                inputs.append(spec)
        spec = InputSpec(pname, param.kind.name, param.default is not param.empty,
                         encode(param.default) if param.default is not param.empty and _encodable(param.default) else None,
                         pname in dummy_forward_args)
        if pname in dummy_forward_args:
            call_kwargs[pname] = _input_leaves(tracer, dummy_forward_args[pname], (), pname, spec.leaves)
            if _is_scalar(dummy_forward_args[pname]):  # a constant of the program: calls are checked against it
                spec.constant = [dummy_forward_args[pname]]
        elif param.default is not param.empty and param.default is not None and _is_scalar(param.default):
            spec.constant = [param.default]
        elif param.default is param.empty and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"dummy_forward_args is missing {pname!r}, a required parameter of "
                            f"{type(module).__qualname__}.forward")
        inputs.append(spec)

    for spec in inputs:  # guards name the forward argument a value derives from
        for path, ref in spec.leaves:
            tracer.input_names[ref.id] = spec.name + "".join(f"[{p!r}]" for p in path)
    if results is not None:
        results.start(_tensors(call_kwargs), False)
    warn_module_hooks(module)
    experts = experts_recorded_whole(module)  # transformers' experts modules: one routed_experts op each
    experts.__enter__()
    saved = tracer.saved = SavedState(module)
    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(tracer.enter_module),
             torch.nn.modules.module.register_module_forward_hook(tracer.exit_module)]
    try:
        # grad on, as in a training forward: the ops record the user's own torch.no_grad() regions
        with torch.enable_grad(), tracing_context.activate(tracer), keep_functions(tracer), \
                watch_python_randomness(module), tracer.recording():
            out = module(**call_kwargs)
        rebound = saved.rebound()
        changed = saved.changed_attributes(tracer.module_path)
        unrestorable = saved.unrestorable_params()
    finally:
        for h in hooks:
            h.remove()
        saved.restore()
        experts.__exit__(None, None, None)
    if unrestorable:
        raise TraceError(f"forward changed the parameter(s) {', '.join(unrestorable)} in place by a route the "
                         f"trace cannot follow (inside a custom op or autograd Function), so the model now "
                         f"differs from before parallelize(); update parameters with torch ops in forward "
                         f"(under torch.no_grad()), or outside forward")
    output = tracer.to_refs(out)
    graph = IRGraph(f"{type(module).__module__}.{type(module).__qualname__}", inputs, params, buffers,
                    tracer.constants, tracer.values, tracer.nodes, output, constant_folding,
                    dict(tracer.module_types))
    graph.buffer_updates = buffer_updates_of(tracer, rebound, by_id)
    if changed:
        warn_user(f"forward changes the Python attribute(s) {', '.join(changed)} of the module; the generated "
                  f"code does not (it runs the ops only), so they keep their values. Keep state that forward "
                  f"updates in a buffer (register_buffer) instead", TracingWarning)
    _eliminate_dead_code(graph)
    return graph


def _is_scalar(obj) -> bool:
    """A Python scalar the generated code checks calls against (finite floats only: nan != nan)."""
    if type(obj) is float:
        return obj == obj and obj not in (float("inf"), float("-inf"))
    return obj is None or type(obj) in (bool, int, str)


def _encodable(obj) -> bool:
    try:
        encode(obj)
        return True
    except TypeError:
        return False


def _eliminate_dead_code(graph: IRGraph) -> None:
    live = {r.id for r in iter_refs(graph.output)} | {r.id for r in iter_refs(graph.buffer_updates)}
    kept = []
    for node in reversed(graph.nodes):
        outs = {r.id for r in node.output_refs()}
        if node.inplace or outs & live or is_guard(node):  # guards check the data on every step
            kept.append(node)
            live.update(r.id for r in node.input_refs())
    kept.reverse()
    graph.nodes = kept
    graph.constants = {k: v for k, v in graph.constants.items() if v.value.id in live}
    used = live | {s.value.id for s in graph.tensor_specs()} | {r.id for i in graph.inputs for _, r in i.leaves}
    used |= {r.id for n in kept for r in n.output_refs()}
    graph.values = {k: v for k, v in graph.values.items() if k in used}
