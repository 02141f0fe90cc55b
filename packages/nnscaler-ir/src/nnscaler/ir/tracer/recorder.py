"""The recorder: a TorchFunctionMode that sees every torch-level call of the user's forward and
a `Tracer` that runs it (on the trace device) and records it as a node with its inputs, outputs,
module path, source line, grad mode and annotation. `trace.py` drives it over a module. The
helpers around it use its public surface only (`TracerSurface`, surface.py)."""
from __future__ import annotations

import itertools
import sys
from typing import Dict, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from ..errors import TraceError
from ..graph import Node, Ref, SourceLoc, TensorSpec, Value, dtype_name, encode
from ..ops.op_names import op_name
from ..ops.registry import REGISTRY
from .guards import record_value_read
from .identity_results import distinct_alias, returned_unchanged, traced_inputs
from .replay import MISS, CallResults
from .symbolic_int import TracedInt
from .trace_device import ExecutionDevice
from .trace_state import SavedState, autocast_region
from ..user_code import is_internal

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
    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.tracer.on_call(func, args, kwargs or {})


class Tracer:
    """One run of the user's forward, recorded (implements `TracerSurface`).

    `flips`: the numbers of the boolean decisions on tensor values that this trace takes the other
    way (nnscaler.ir.tracer.branches). `results`: the first trace's results to take instead of
    running the same calls again, or this first trace's to keep (nnscaler.ir.tracer.replay)."""

    def __init__(self, module: torch.nn.Module, constant_folding: bool, device: ExecutionDevice,
                 flips=frozenset(), results: Optional[CallResults] = None):
        self.module = module
        self.constant_folding = constant_folding
        self.device = device
        self.values: Dict[int, Value] = {}
        self.nodes: list = []
        self._ids = itertools.count()
        self._tensor_values: Dict[int, tuple] = {}  # id(tensor) -> (tensor, Ref); keeps tensors alive
        self.constants: Dict[str, TensorSpec] = {}
        self._module_stack = [""]
        self.function_grad: List[Tuple[type, bool]] = []  # (class, caller's grad mode) of each enclosing Function.apply
        self.saved: Optional[SavedState] = None  # set while the forward runs
        self._module_names: Dict[int, str] = {}
        # value reads become guards (nnscaler.ir.tracer.guards); decision k in `flips` returns the other branch
        self.input_names: Dict[int, str] = {}  # graph input value id -> "attention_mask", "batch['mask']"
        self.param_names: Dict[int, str] = {}  # parameter/buffer value id -> full name
        self._decisions = 0  # bool() reads so far
        self.flips = frozenset(flips)
        self._results = results
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

    def is_bound(self, tensor: torch.Tensor) -> bool:
        hit = self._tensor_values.get(id(tensor))
        return hit is not None and hit[0] is tensor

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
        if self._results is not None:
            self._results.constant(tensor)
        return ref

    def to_refs(self, obj):
        if isinstance(obj, TracedInt):
            ref = obj.ref_in(self)
            if ref is not None:
                return ref
        if isinstance(obj, torch.Tensor):
            return self.ref_of_tensor(obj)
        if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
            items = [self.to_refs(x) for x in obj]
            return items if isinstance(obj, list) else tuple(items)
        if isinstance(obj, dict):
            return {k: self.to_refs(v) for k, v in obj.items()}
        if isinstance(obj, slice):
            return slice(self.to_refs(obj.start), self.to_refs(obj.stop), self.to_refs(obj.step))
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

    def add_node(self, target: str, args, kwargs, outputs, annotation=None, inplace=False) -> Node:
        node = Node(len(self.nodes), target, list(args), dict(kwargs), outputs, self._module_stack[-1],
                    self.source_location(), annotation, inplace,
                    grad_enabled=self.grad_enabled(), autocast=autocast_region())
        self.nodes.append(node)
        return node

    def next_decision(self) -> int:
        self._decisions += 1
        return self._decisions - 1

    def module_path(self, module: torch.nn.Module) -> Optional[str]:
        return self._module_names.get(id(module))

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
        return self.function_grad[-1][1] if self.function_grad else torch.is_grad_enabled()

    def wrap_outputs(self, result, hint: str, inputs=None):
        """Give every tensor (and traced int) in `result` a fresh value; return (refs, result).

        `inputs` (``traced_inputs`` of a call that is not in place): a tensor of `result` that is
        one of them, returned unchanged (``x.float()`` on float32), is handed back as a distinct
        alias, so ``x`` keeps its own value (nnscaler.ir.tracer.identity_results)."""
        if isinstance(result, torch.Tensor):
            ref = self.new_value(result, hint)
            if inputs and returned_unchanged(result, inputs):
                result = distinct_alias(result)
            self.bind_tensor(result, ref)
            return ref, result
        if isinstance(result, (tuple, list)) and not isinstance(result, torch.Size):
            pairs = [self.wrap_outputs(r, hint, inputs) for r in result]
            refs = [p[0] for p in pairs]
            objs = [p[1] for p in pairs]
            if isinstance(result, list):
                return refs, objs
            if hasattr(result, "_fields"):  # namedtuple
                return tuple(refs), type(result)(*objs)
            if hasattr(result, "n_fields"):  # structseq (torch.return_types.max ...: .values, .indices)
                return tuple(refs), type(result)(objs)
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
            if attr == "data" and self._results is not None:  # writes through .data bump no version
                self._results.forget(args[0])
            real = self.device.run(func, args, kwargs)
            if attr == "shape" and not self.constant_folding:
                return self._record_size(args[0], real, "getattr", (args[0], "shape"))
            if isinstance(real, torch.Tensor):
                refs, real = self.wrap_outputs(real, attr.strip("_"), traced_inputs(self, args))  # x.real is x
                self.add_node("getattr", (self.to_refs(args[0]), attr), {}, refs)
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
        arg_refs, kwarg_refs = self.to_refs(tuple(args)), self.to_refs(dict(kwargs))
        inplace = ((name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS
                   or kwargs.get("out") is not None or kwargs.get("inplace") is True)
        if inplace and self.saved is not None:  # the trace must leave the user's weights as they were
            self.saved.before_write(kwargs.get("out", args[0] if args else None))
        inputs = None if inplace else traced_inputs(self, args, kwargs)  # x.float() may return x itself
        key = None if inplace or self._results is None else self._results.key(func, target, args, kwargs)
        taken = MISS if key is None else self._results.take(key)  # the first trace's result (replay.py)
        ran = taken is MISS
        if not ran:
            real, annotation = taken
        else:
            try:
                real = self.device.run(func, args, kwargs)
            except Exception as e:
                loc = self.source_location()
                raise TraceError(f"tracing failed in {target} called at {loc}: {type(e).__name__}: {e}") from e
        if name == "__setitem__":
            real = args[0]
        if real is None or (not _has_tensor(real) and self.constant_folding):
            if inplace:  # mutation with no tensor result: record it for its effect
                self.add_node(target, arg_refs, kwarg_refs, None, inplace=True)
            return real
        hint = name.strip("_") or "out"
        refs, result = self.wrap_outputs(real, hint, inputs)
        if ran:
            annotation = self._annotation(func, args, kwargs, annotation_fn)
            if annotation is not None:  # a register_op annotation of a torch function is checked like a custom op's
                REGISTRY.check_call(func, func, annotation, args, kwargs, real)
        if self._results is not None:
            self._results.after(key, target, args, inputs, real, result, annotation, ran)
        self.add_node(target, arg_refs, kwarg_refs, refs, annotation, inplace)
        return result

    def _annotation(self, func, args, kwargs, annotation_fn):
        # REGISTRY.lookup: None for an unannotated op; a user's broken annotation raises (never a
        # silent replication)
        return REGISTRY.lookup(func, args, kwargs)

    def _record_size(self, tensor, real, target, args, kwargs=None):
        arg_refs, kwarg_refs = self.to_refs(tuple(args)), self.to_refs(dict(kwargs or {}))
        if isinstance(real, int):
            ref = self.new_value(real, "size")
            self.add_node(target, arg_refs, kwarg_refs, ref)
            return TracedInt(real, self, ref)
        refs = tuple(self.new_value(int(d), "size") for d in real)
        self.add_node(target, arg_refs, kwarg_refs, refs)
        return TracedSize(TracedInt(int(d), self, r) for d, r in zip(real, refs))

    def record_int_op(self, op, args):
        plain = [int(a) for a in args]
        result = op(*plain)
        ref = self.new_value(result, op.__name__)
        self.add_node(f"operator.{op.__name__}", self.to_refs(tuple(args)), {}, ref)
        return TracedInt(result, self, ref)

    def record_custom_op(self, fn, args, kwargs):
        """Record a call of a `register_op` function as one node (called by its wrapper)."""
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", "")
        if not module or "<locals>" in qualname or module == "__main__":
            raise TraceError(
                f"custom op {qualname or fn!r} must be a module-level function in an importable module "
                f"(generated code imports it by name); it is defined in {module}.{qualname}")
        wrapper = getattr(fn, "__nnscaler_wrapper__", fn)
        annotation = REGISTRY.lookup(wrapper, args, kwargs) or REGISTRY.lookup(fn, args, kwargs)
        arg_refs, kwarg_refs = self.to_refs(tuple(args)), self.to_refs(dict(kwargs))
        inputs = traced_inputs(self, args, kwargs)  # an input returned unwritten is a new value, not x's
        real = self.device.run(fn, args, kwargs, mode_off=True)
        REGISTRY.check_call(wrapper, fn, annotation, args, kwargs, real)  # the annotation fits and splits right
        refs, result = self.wrap_outputs(real, qualname.rsplit(".", 1)[-1], inputs)
        self.add_node(f"{module}.{qualname}", arg_refs, kwarg_refs, refs, annotation)
        return result

    # -- driving the forward (trace.py) ---------------------------------------------------------
    def recording(self) -> TorchFunctionMode:
        """The mode under which the forward runs: every torch-level call comes to `on_call`."""
        return _RecordingMode(self)

    def enter_module(self, mod, args):
        """A global forward pre-hook: ops from now on run in `mod` (its path) until `exit_module`."""
        path = self._module_names.get(id(mod), self._module_stack[-1])
        self._module_stack.append(path)
        self.module_types.setdefault(path, f"{type(mod).__module__}.{type(mod).__qualname__}")

    def exit_module(self, mod, args, out):
        """A global forward hook: back to the enclosing module's path."""
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
