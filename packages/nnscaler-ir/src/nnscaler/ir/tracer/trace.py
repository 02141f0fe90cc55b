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
import itertools
import sys
import warnings
from typing import Any, Dict, Optional

import torch
from torch.overrides import TorchFunctionMode

from . import tracing_context
from ..graph import (IRGraph, InputSpec, Node, Ref, SourceLoc, TensorSpec, Value, dtype_name, encode,
                    iter_refs)
from .branches import decisions_of, merge_branches
from .kept_functions import keep_functions, settle_grad_modes
from .guards import is_guard, record_value_read, warn_guards
from .example_inputs import check_trace_inputs
from .modes import annotate_modes, mode_name
from ..ops.op_names import op_name
from .symbolic_int import TracedInt
from .trace_device import ExecutionDevice
from .trace_state import (TraceError, TracingWarning, SavedState, autocast_region, buffer_updates_of,
                          function_grad_mode, warn_module_hooks)
from ..user_code import is_internal, warn_user

_SIZE_FUNCS = {"size", "numel"}
_FOLDED_ATTRS = {"dtype", "device", "is_cuda", "is_meta", "requires_grad", "ndim", "layout", "is_leaf",
                 "grad_fn", "names", "is_sparse", "is_quantized", "data_ptr", "dim", "element_size",
                 "is_contiguous", "is_floating_point", "is_complex", "get_device", "__len__", "__format__",
                 "__repr__", "__bool__", "__int__", "__float__", "__index__", "__hash__", "item", "tolist",
                 "stride", "storage_offset", "untyped_storage", "__array__", "numpy"}
_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__"}



# Reading a traced tensor's values in Python: the result is frozen into the program.
_VALUE_READS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "__array__", "numpy"}


class _RecordingMode(TorchFunctionMode):
    def __init__(self, tracer: "Tracer"):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.tracer.on_call(func, args, kwargs or {})


class Tracer:
    def __init__(self, module: torch.nn.Module, constant_folding: bool, device: ExecutionDevice):
        self.module = module
        self.constant_folding = constant_folding
        self.device = device
        self.values: Dict[int, Value] = {}
        self.nodes: list = []
        self._ids = itertools.count()
        self._tensor_values: Dict[int, tuple] = {}  # id(tensor) -> (tensor, Ref); keeps tensors alive
        self.constants: Dict[str, TensorSpec] = {}
        self._module_stack = [""]
        self._function_grad: list = []  # (class, caller's grad mode) of each enclosing autograd.Function.apply
        self._kept_classes: Dict[type, Any] = {}  # user autograd Functions recording themselves
        self.saved: Optional[SavedState] = None  # set while the forward runs
        self._kept_nodes: list = []  # (node, input tensors, output tensors) of each kept Function call
        self._module_names = {}
        # value reads become guards (nnscaler.ir.tracer.guards); decision k in `flips` returns the other branch
        self.input_names: Dict[int, str] = {}  # graph input value id -> "attention_mask", "batch['mask']"
        self.param_names: Dict[int, str] = {}  # parameter/buffer value id -> full name
        self.decisions = 0  # bool() reads so far
        self.flips: set = set()
        self._producers: Dict[int, Node] = {}
        self._indexed = 0
        self.module_types: Dict[str, str] = {}  # module path -> "package.module.Class"
        for name, mod in module.named_modules(remove_duplicate=False):
            self._module_names.setdefault(id(mod), name)

    # -- values ----------------------------------------------------------------------------------
    def new_value(self, obj, hint: str) -> Ref:
        vid = next(self._ids)
        if isinstance(obj, torch.Tensor):
            v = Value(vid, "tensor", hint, tuple(obj.shape), dtype_name(obj.dtype), obj.requires_grad)
        elif isinstance(obj, int):
            v = Value(vid, "int", hint)
        else:
            v = Value(vid, "object", hint)
        self.values[vid] = v
        return Ref(vid)

    def bind_tensor(self, tensor: torch.Tensor, ref: Ref) -> None:
        self._tensor_values[id(tensor)] = (tensor, ref)

    def ref_of_tensor(self, tensor: torch.Tensor) -> Ref:
        hit = self._tensor_values.get(id(tensor))
        if hit is not None and hit[0] is tensor:
            return hit[1]
        # A tensor that is neither an input, a parameter/buffer nor an op's output: a tensor
        # constant captured by the user's code (a plain attribute, a global). Saved with the weights.
        name = f"_constant_{len(self.constants)}"
        ref = self.new_value(tensor, name)
        self.constants[name] = TensorSpec(name, ref, tuple(tensor.shape), dtype_name(tensor.dtype),
                                          False, [], True)
        self.constants[name].tensor = tensor.detach().to("cpu") if tensor.device.type != "meta" else None
        self.bind_tensor(tensor, ref)
        return ref

    def _to_refs(self, obj):
        if isinstance(obj, TracedInt) and obj._tracer is self:
            return obj._ref
        if isinstance(obj, torch.Tensor):
            return self.ref_of_tensor(obj)
        if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
            items = [self._to_refs(x) for x in obj]
            return items if isinstance(obj, list) else tuple(items)
        if isinstance(obj, dict):
            return {k: self._to_refs(v) for k, v in obj.items()}
        if isinstance(obj, slice):
            return slice(self._to_refs(obj.start), self._to_refs(obj.stop), self._to_refs(obj.step))
        if type(obj).__module__ == "numpy" and getattr(obj, "ndim", None) == 0:
            return obj.item()  # a numpy scalar (np.prod(shape)): record the Python number
        encode(obj)  # raises TypeError for objects generated code could not rebuild
        return obj

    # -- recording -----------------------------------------------------------------------------
    def source_location(self) -> Optional[SourceLoc]:
        frame = sys._getframe(2)
        while frame is not None:
            filename = frame.f_code.co_filename
            if not is_internal(filename):
                import linecache
                code = linecache.getline(filename, frame.f_lineno).strip()
                return SourceLoc(filename, frame.f_lineno, code, frame.f_code.co_qualname)
            frame = frame.f_back
        return None

    def _add_node(self, target: str, args, kwargs, outputs, annotation=None, inplace=False) -> Node:
        node = Node(len(self.nodes), target, list(args), dict(kwargs), outputs, self._module_stack[-1],
                    self.source_location(), annotation, inplace,
                    grad_enabled=self.grad_enabled(), autocast=autocast_region())
        self.nodes.append(node)
        return node

    def producer_index(self) -> Dict[int, Node]:
        """value id -> the node that produced it (so far)."""
        for node in self.nodes[self._indexed:]:
            for r in node.output_refs():
                self._producers[r.id] = node
        self._indexed = len(self.nodes)
        return self._producers

    def _in_graph(self, obj) -> bool:
        """An input, parameter, buffer or op output (not a captured constant)."""
        hit = self._tensor_values.get(id(obj)) if isinstance(obj, torch.Tensor) else None
        return hit is not None and hit[0] is obj and not self.values[hit[1].id].name.startswith("_constant_")

    def grad_enabled(self) -> bool:
        """The user's grad mode: inside an autograd.Function's forward (torch turns grad off there,
        e.g. a reentrant torch.utils.checkpoint), the mode the Function was called in."""
        return self._function_grad[-1][1] if self._function_grad else torch.is_grad_enabled()

    def _wrap_outputs(self, result, hint: str, inplace_target=None):
        """Give every tensor (and traced int) in `result` a fresh value; return (refs, result)."""
        if isinstance(result, torch.Tensor):
            ref = self.new_value(result, hint)
            self.bind_tensor(result, ref)
            return ref, result
        if isinstance(result, (tuple, list)) and not isinstance(result, torch.Size):
            pairs = [self._wrap_outputs(r, hint) for r in result]
            refs = [p[0] for p in pairs]
            objs = [p[1] for p in pairs]
            if isinstance(result, list):
                return refs, objs
            if hasattr(result, "_fields"):  # namedtuple (torch.return_types.max ...)
                return tuple(refs), type(result)(*objs)
            return tuple(refs), tuple(objs)
        if isinstance(result, int) and not isinstance(result, bool) and not self.constant_folding:
            ref = self.new_value(result, hint)
            return ref, TracedInt(result, self, ref)
        return result, result

    def on_call(self, func, args, kwargs):
        name = getattr(func, "__name__", "")
        owner = getattr(func, "__self__", None)
        if name == "__get__" and owner is not None:  # a Tensor property such as x.shape or x.T
            attr = owner.__name__
            real = self.device.run(func, args, kwargs)
            if attr == "shape" and not self.constant_folding:
                return self._record_size(args[0], real, "getattr", (args[0], "shape"))
            if isinstance(real, torch.Tensor):
                refs, real = self._wrap_outputs(real, attr.strip("_"))
                self._add_node("getattr", (self._to_refs(args[0]), attr), {}, refs)
            return real
        if name in _FOLDED_ATTRS:
            real = self.device.run(func, args, kwargs)
            if name in _VALUE_READS and args and self._in_graph(args[0]):
                node = record_value_read(self, name, args[0], real)  # a guard (nnscaler.ir.tracer.guards)
                if name == "__bool__" and node.kwargs["decision"] in self.flips:
                    node.kwargs["traced"] = not real  # the branch this trace follows: its guard checks it
                    return not real  # tracing the other branch (nnscaler.ir.tracer.branches)
            return real
        if name in _SIZE_FUNCS:
            real = self.device.run(func, args, kwargs)
            if self.constant_folding:
                return real
            return self._record_size(args[0], real, op_name(func), args, kwargs)
        if name == "__iter__":  # iterate a tensor -> unbind(0)
            return iter(self.on_call(torch.Tensor.unbind, (args[0],), {}))
        return self.record_call(func, op_name(func), args, kwargs, name)

    def record_call(self, func, target: str, args, kwargs, name: str, annotation_fn=None):
        arg_refs, kwarg_refs = self._to_refs(tuple(args)), self._to_refs(dict(kwargs))
        inplace = ((name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS
                   or kwargs.get("out") is not None or kwargs.get("inplace") is True)
        if inplace and self.saved is not None:  # the trace must leave the user's weights as they were
            self.saved.before_write(kwargs.get("out", args[0] if args else None))
        try:
            real = self.device.run(func, args, kwargs)
        except Exception as e:
            loc = self.source_location()
            raise TraceError(f"tracing failed in {target} called at {loc}: {type(e).__name__}: {e}") from e
        if name == "__setitem__":
            real = args[0]
        if real is None or (not _has_tensor(real) and self.constant_folding):
            if inplace:  # mutation with no tensor result: record it for its effect
                self._add_node(target, arg_refs, kwarg_refs, None, inplace=True)
            return real
        hint = name.strip("_") or "out"
        refs, result = self._wrap_outputs(real, hint)
        annotation = self._annotation(func, args, kwargs, annotation_fn)
        if annotation is not None:  # a register_op annotation of a torch function is checked like a custom op's
            from ..ops.registry import REGISTRY
            REGISTRY.check_call(func, func, annotation, args, kwargs, real)
        self._add_node(target, arg_refs, kwarg_refs, refs, annotation, inplace)
        return result

    def _annotation(self, func, args, kwargs, annotation_fn):
        # REGISTRY.lookup: None for an unannotated op; a user's broken annotation raises (never a
        # silent replication)
        from ..ops.registry import REGISTRY
        return REGISTRY.lookup(func, args, kwargs)

    def _record_size(self, tensor, real, target, args, kwargs=None):
        arg_refs, kwarg_refs = self._to_refs(tuple(args)), self._to_refs(dict(kwargs or {}))
        if isinstance(real, int):
            ref = self.new_value(real, "size")
            self._add_node(target, arg_refs, kwarg_refs, ref)
            return TracedInt(real, self, ref)
        refs = tuple(self.new_value(int(d), "size") for d in real)
        self._add_node(target, arg_refs, kwarg_refs, refs)
        return TracedSize(TracedInt(int(d), self, r) for d, r in zip(real, refs))

    def record_int_op(self, op, args):
        plain = [int(a) for a in args]
        result = op(*plain)
        ref = self.new_value(result, op.__name__)
        self._add_node(f"operator.{op.__name__}", self._to_refs(tuple(args)), {}, ref)
        return TracedInt(result, self, ref)

    def record_custom_op(self, fn, args, kwargs):
        """Record a call of a `register_op` function as one node (called by its wrapper)."""
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", "")
        if not module or "<locals>" in qualname or module == "__main__":
            raise TraceError(
                f"custom op {qualname or fn!r} must be a module-level function in an importable module "
                f"(generated code imports it by name); it is defined in {module}.{qualname}")
        from ..ops.registry import REGISTRY
        wrapper = getattr(fn, "__nnscaler_wrapper__", fn)
        annotation = REGISTRY.lookup(wrapper, args, kwargs) or REGISTRY.lookup(fn, args, kwargs)
        arg_refs, kwarg_refs = self._to_refs(tuple(args)), self._to_refs(dict(kwargs))
        real = self.device.run(fn, args, kwargs, mode_off=True)
        REGISTRY.check_call(wrapper, fn, annotation, args, kwargs, real)  # the annotation fits and splits right
        refs, result = self._wrap_outputs(real, qualname.rsplit(".", 1)[-1])
        self._add_node(f"{module}.{qualname}", arg_refs, kwarg_refs, refs, annotation)
        return result

    # -- module path bookkeeping ------------------------------------------------------------------
    def _pre_hook(self, mod, args):
        path = self._module_names.get(id(mod), self._module_stack[-1])
        self._module_stack.append(path)
        self.module_types.setdefault(path, f"{type(mod).__module__}.{type(mod).__qualname__}")

    def _post_hook(self, mod, args, out):
        if len(self._module_stack) > 1:
            self._module_stack.pop()


class TracedSize(tuple):
    """The shape of a tensor whose entries are TracedInts (constant folding off)."""

    def numel(self):
        n = 1
        for d in self:
            n = n * d
        return n


def _has_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, (tuple, list)):
        return any(_has_tensor(x) for x in obj)
    return isinstance(obj, TracedInt)


def _input_leaves(tracer: Tracer, obj, path: tuple, hint: str, leaves: list):
    """Bind every tensor in a (nested) forward argument to a graph input value."""
    if isinstance(obj, torch.Tensor):
        ref = tracer.new_value(obj, hint)
        leaves.append((path, ref))
        twin = tracer.device.input_twin(obj)
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


def trace(module: torch.nn.Module, dummy_forward_args: Dict[str, Any], *, constant_folding: bool = False,
          trace_strategy: str = "cpu", both_modes: bool = True, both_branches: bool = True) -> IRGraph:
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
    """
    check_trace_inputs(module, dummy_forward_args)  # NumPy inputs, quantized/sparse tensors: named refusals
    graph = _trace_once(module, dummy_forward_args, constant_folding, trace_strategy)
    graph.traced_training = module.training
    if both_modes:
        flags = [(m, m.training) for m in module.modules()]
        module.train(not module.training)
        try:
            with warnings.catch_warnings():  # the first trace has said it all
                warnings.simplefilter("ignore")
                other = _trace_once(module, dummy_forward_args, constant_folding, trace_strategy)
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
                return _trace_once(module, dummy_forward_args, constant_folding, trace_strategy, flips)
        merge_branches(graph, retrace)
    warn_guards(graph)
    return graph


def _trace_once(module: torch.nn.Module, dummy_forward_args: Dict[str, Any], constant_folding: bool,
                trace_strategy: str, flips=frozenset()) -> IRGraph:
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
    tracer = Tracer(module, constant_folding, device)
    tracer.flips = set(flips)

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
    buffers = bind_named(module.named_buffers(remove_duplicate=False))

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
        elif param.default is param.empty and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"dummy_forward_args is missing {pname!r}, a required parameter of "
                            f"{type(module).__qualname__}.forward")
        inputs.append(spec)

    for spec in inputs:  # guards name the forward argument a value derives from
        for path, ref in spec.leaves:
            tracer.input_names[ref.id] = spec.name + "".join(f"[{p!r}]" for p in path)
    warn_module_hooks(module)
    saved = tracer.saved = SavedState(module)
    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(tracer._pre_hook),
             torch.nn.modules.module.register_module_forward_hook(tracer._post_hook)]
    try:
        # grad on, as in a training forward: the ops record the user's own torch.no_grad() regions
        with torch.enable_grad(), tracing_context.activate(tracer), keep_functions(tracer), \
                function_grad_mode(tracer), _RecordingMode(tracer):
            out = module(**call_kwargs)
        settle_grad_modes(tracer)
        rebound = saved.rebound()
        changed = saved.changed_attributes(tracer._module_names)
        unrestorable = saved.unrestorable_params()
    finally:
        for h in hooks:
            h.remove()
        saved.restore()
    if unrestorable:
        raise TraceError(f"forward changed the parameter(s) {', '.join(unrestorable)} in place by a route the "
                         f"trace cannot follow (inside a custom op or autograd Function), so the model now "
                         f"differs from before parallelize(); update parameters with torch ops in forward "
                         f"(under torch.no_grad()), or outside forward")
    output = tracer._to_refs(out)
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
