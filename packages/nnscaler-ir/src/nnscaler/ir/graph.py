"""IRGraph: the traced program of one module's forward, as a list of ops over values.

A *value* is what flows between ops: a tensor (with shape, dtype, requires_grad), an int
computed from shapes (kept symbolic when constant folding is off) or another object. An op
(`Node`) names the function it calls (`target`, a dotted path such as
``torch.nn.functional.linear`` or ``torch.Tensor.view``), its arguments (nested Python values
whose leaves are constants or `Ref`s to values), its outputs, the module path it ran in and the
user's source line. Parameters and buffers keep their original names; tied parameters are one
tensor with aliases; frozen parameters are marked. The graph serialises to JSON (no pickle).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import torch

from .tree import iter_leaves


@dataclass(frozen=True)
class Ref:
    """A reference to a graph value inside an op's arguments or outputs."""

    id: int


@dataclass
class Value:
    id: int
    kind: str  # 'tensor' | 'int' | 'object'
    name: str  # readable name hint for generated code
    shape: Optional[tuple] = None
    dtype: Optional[str] = None
    requires_grad: bool = False

    @property
    def is_tensor(self) -> bool:
        return self.kind == "tensor"


@dataclass
class SourceLoc:
    file: str
    line: int
    code: str = ""
    function: str = ""

    def short(self) -> str:
        import os
        return f"{os.path.basename(self.file)}:{self.line}"

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}"
        if self.function:
            where += f" in {self.function}"
        return f"{where}: {self.code}" if self.code else where


@dataclass
class Node:
    id: int
    target: str
    args: list
    kwargs: dict
    outputs: Any  # a Ref, or a tuple/list of Refs (nested)
    module_path: str = ""
    source: Optional[SourceLoc] = None
    annotation: Optional[str] = None
    inplace: bool = False
    # Filled by policies: one entry per piece of this op (see nnscaler.policies), and the
    # recompute group the op belongs to (ops of one group are recomputed together in backward).
    pieces: list = field(default_factory=list)
    recompute: Optional[str] = None
    stage: Optional[int] = None  # pipeline stage (set by the policy's staging; None: no pipeline)
    # Filled by trace in both modes (nnscaler.ir.tracer.modes): constant arguments that differ between
    # training and eval ([where, key, training value, eval value]), and the one mode an op runs
    # in when the other mode's trace does not have it (None: both).
    mode_args: list = field(default_factory=list)
    only_when: Optional[bool] = None
    # The grad mode and autocast region the user's forward ran the op in (`with torch.no_grad():`,
    # `with torch.autocast(...)`): autocast is [device type, dtype name] or None.
    grad_enabled: bool = True
    autocast: Optional[list] = None
    # Filled by trace when both branches of a Python decision on a tensor value are traced
    # (nnscaler.ir.tracer.branches): [id of the decision's guard node, the decision's value] when the op runs
    # in that branch only; arguments that differ between the branches ([where, key, decision guard id,
    # value when True, value when False]); `args`/`kwargs` hold one of the two.
    branch: Optional[list] = None
    branch_args: list = field(default_factory=list)

    @property
    def short_name(self) -> str:
        return self.target.rsplit(".", 1)[-1]

    def input_refs(self) -> List[Ref]:
        return list(iter_refs((self.args, self.kwargs)))

    def output_refs(self) -> List[Ref]:
        return list(iter_refs(self.outputs))

    def describe(self) -> str:
        where = f" (module {self.module_path})" if self.module_path else ""
        src = f" at {self.source}" if self.source else ""
        return f"{self.target}{where}{src}"


@dataclass
class InputSpec:
    """One parameter of the traced forward: tensors inside it are graph inputs found by path."""

    name: str
    kind: str  # inspect.Parameter kind name: POSITIONAL_OR_KEYWORD, KEYWORD_ONLY, VAR_POSITIONAL...
    has_default: bool
    default: Any = None  # encoded constant (only when has_default)
    traced: bool = False  # True when a dummy value was given for it
    leaves: List[tuple] = field(default_factory=list)  # (access path, Ref): tensors and ints in it
    # [value] when the program computed with a Python scalar here (the dummy value, or the default
    # when none was given: bool, int, float, str or None): a constant of the generated code
    constant: Optional[list] = None


@dataclass
class TensorSpec:
    """A parameter, buffer or captured constant of the module, by its original full name."""

    name: str
    value: Ref
    shape: tuple
    dtype: str
    requires_grad: bool = False
    aliases: List[str] = field(default_factory=list)  # other names of the same (tied) tensor
    persistent: bool = True


@dataclass
class IRGraph:
    module_class: str
    inputs: List[InputSpec]
    params: Dict[str, TensorSpec]
    buffers: Dict[str, TensorSpec]
    constants: Dict[str, TensorSpec]
    values: Dict[int, Value]
    nodes: List[Node]
    output: Any  # nested structure of Refs and constants
    constant_folding: bool = False
    module_types: Dict[str, str] = field(default_factory=dict)  # module path -> "pkg.mod.Class"
    pipeline: Any = None  # a nnscaler.ir.pipeline_plan.PipelinePlan once a policy staged the graph
    traced_training: bool = True  # the module's mode when traced
    buffer_updates: Dict[str, Any] = field(default_factory=dict)  # buffer forward rebinds -> new value
    mode_divergence: Optional[str] = None  # where the other mode runs other ops (nnscaler.ir.tracer.modes)

    # -- queries -----------------------------------------------------------------------------
    def value(self, ref: Ref) -> Value:
        return self.values[ref.id]

    def producers(self) -> Dict[int, Node]:
        return {r.id: n for n in self.nodes for r in n.output_refs()}

    def consumers(self) -> Dict[int, List[Node]]:
        out: Dict[int, List[Node]] = {}
        for n in self.nodes:
            for r in n.input_refs():
                out.setdefault(r.id, []).append(n)
        return out

    @property
    def trainable_params(self) -> Dict[str, TensorSpec]:
        return {k: v for k, v in self.params.items() if v.requires_grad}

    @property
    def frozen_params(self) -> Dict[str, TensorSpec]:
        return {k: v for k, v in self.params.items() if not v.requires_grad}

    def tensor_specs(self) -> Iterator[TensorSpec]:
        yield from self.params.values()
        yield from self.buffers.values()
        yield from self.constants.values()

    # -- serialisation ------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "module_class": self.module_class,
            "constant_folding": self.constant_folding,
            "module_types": dict(self.module_types),
            "inputs": [{"name": i.name, "kind": i.kind, "has_default": i.has_default,
                        "default": i.default, "traced": i.traced,
                        "leaves": [[encode(p), r.id] for p, r in i.leaves],
                        **({"constant": i.constant} if i.constant is not None else {})} for i in self.inputs],
            "params": [_spec_json(s) for s in self.params.values()],
            "buffers": [_spec_json(s) for s in self.buffers.values()],
            "constants": [_spec_json(s) for s in self.constants.values()],
            "values": [[v.id, v.kind, v.name, list(v.shape) if v.shape is not None else None,
                        v.dtype, v.requires_grad] for v in self.values.values()],
            "nodes": [{"id": n.id, "target": n.target, "args": encode(n.args), "kwargs": encode(n.kwargs),
                       "outputs": encode(n.outputs), "module_path": n.module_path,
                       "source": [n.source.file, n.source.line, n.source.code, n.source.function] if n.source else None,
                       "annotation": n.annotation, "inplace": n.inplace,
                       "mode_args": encode(n.mode_args), "only_when": n.only_when,
                       "grad_enabled": n.grad_enabled, "autocast": n.autocast,
                       "branch": n.branch, "branch_args": encode(n.branch_args)} for n in self.nodes],
            "output": encode(self.output),
            "traced_training": self.traced_training,
            "buffer_updates": encode(self.buffer_updates),
            "mode_divergence": self.mode_divergence,
        }

    @classmethod
    def from_json(cls, data: dict) -> "IRGraph":
        values = {v[0]: Value(v[0], v[1], v[2], tuple(v[3]) if v[3] is not None else None, v[4], v[5])
                  for v in data["values"]}
        nodes = [Node(n["id"], n["target"], decode(n["args"]), decode(n["kwargs"]), decode(n["outputs"]),
                      n["module_path"], SourceLoc(*n["source"]) if n["source"] else None,
                      n["annotation"], n["inplace"], mode_args=decode(n.get("mode_args", [])),
                      only_when=n.get("only_when"), grad_enabled=n.get("grad_enabled", True),
                      autocast=n.get("autocast"), branch=n.get("branch"),
                      branch_args=decode(n.get("branch_args", []))) for n in data["nodes"]]
        inputs = [InputSpec(i["name"], i["kind"], i["has_default"], i["default"], i["traced"],
                            [(decode(p), Ref(r)) for p, r in i["leaves"]], i.get("constant"))
                  for i in data["inputs"]]
        return cls(data["module_class"], inputs,
                   {s["name"]: _spec_from(s) for s in data["params"]},
                   {s["name"]: _spec_from(s) for s in data["buffers"]},
                   {s["name"]: _spec_from(s) for s in data["constants"]},
                   values, nodes, decode(data["output"]), data.get("constant_folding", False),
                   dict(data.get("module_types", {})), traced_training=data.get("traced_training", True),
                   buffer_updates=decode(data.get("buffer_updates", {"$dict": []})),
                   mode_divergence=data.get("mode_divergence"))

    def fingerprint(self) -> str:
        """A hash identifying the traced program (ops, shapes, names), independent of source lines."""
        data = self.to_json()
        for n in data["nodes"]:
            n.pop("source")
            if n["target"] == "nnscaler.runtime.guards.check":  # a guard's library-caller line (ir/tracer/guards.py)
                n["kwargs"] = {"$dict": [kv for kv in n["kwargs"]["$dict"] if kv[0] != "via"]}
        data["mode_divergence"] = data["mode_divergence"] is not None  # names a source line
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def summary(self) -> str:
        lines = [f"IRGraph of {self.module_class}: {len(self.nodes)} ops, {len(self.params)} params, "
                 f"{len(self.buffers)} buffers"]
        for n in self.nodes:
            outs = ", ".join(_value_str(self.value(r)) for r in n.output_refs())
            lines.append(f"  %{n.id} {n.target} -> {outs}   [{n.module_path or '<root>'}]")
        return "\n".join(lines)


def _value_str(v: Value) -> str:
    if v.is_tensor:
        return f"{v.name}:{v.dtype}{list(v.shape)}"
    return f"{v.name}:{v.kind}"


def _spec_json(s: TensorSpec) -> dict:
    return {"name": s.name, "value": s.value.id, "shape": list(s.shape), "dtype": s.dtype,
            "requires_grad": s.requires_grad, "aliases": list(s.aliases), "persistent": s.persistent}


def _spec_from(d: dict) -> TensorSpec:
    return TensorSpec(d["name"], Ref(d["value"]), tuple(d["shape"]), d["dtype"], d["requires_grad"],
                      list(d["aliases"]), d["persistent"])


# -- nested argument structures -------------------------------------------------------------------

def iter_refs(obj) -> Iterator[Ref]:
    """Every Ref inside a nested structure of tuples, lists, dicts and slices."""
    return iter_leaves(obj, Ref, into_slices=True)


def map_refs(obj, fn):
    """A copy of a nested structure with every Ref replaced by fn(ref)."""
    if isinstance(obj, Ref):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(map_refs(x, fn) for x in obj)
    if isinstance(obj, list):
        return [map_refs(x, fn) for x in obj]
    if isinstance(obj, dict):
        return {k: map_refs(v, fn) for k, v in obj.items()}
    if isinstance(obj, slice):
        return slice(map_refs(obj.start, fn), map_refs(obj.stop, fn), map_refs(obj.step, fn))
    return obj


_TORCH_ENUMS = {str(x): x for x in (torch.contiguous_format, torch.channels_last, torch.preserve_format,
                                     torch.strided, torch.sparse_coo)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def encode(obj):
    """Nested constants/Refs -> JSON-able data (tagged dicts for non-JSON types)."""
    if isinstance(obj, Ref):
        return {"$ref": obj.id}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"$float": repr(obj)}
    if isinstance(obj, torch.Size):
        return {"$size": [int(x) for x in obj]}
    if isinstance(obj, tuple):
        return {"$tuple": [encode(x) for x in obj]}
    if isinstance(obj, list):
        return [encode(x) for x in obj]
    if isinstance(obj, dict):
        return {"$dict": [[encode(k), encode(v)] for k, v in obj.items()]}
    if isinstance(obj, slice):
        return {"$slice": [encode(obj.start), encode(obj.stop), encode(obj.step)]}
    if obj is Ellipsis:
        return {"$ellipsis": True}
    if isinstance(obj, torch.dtype):
        return {"$dtype": dtype_name(obj)}
    if isinstance(obj, torch.device):
        return {"$device": str(obj)}
    if isinstance(obj, complex):
        return {"$complex": [obj.real, obj.imag]}
    if str(obj) in _TORCH_ENUMS:
        return {"$torch": str(obj)}
    raise TypeError(f"cannot record constant of type {type(obj).__name__}: {obj!r}")


def decode(obj):
    if isinstance(obj, list):
        return [decode(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    (tag, val), = obj.items()
    if tag == "$ref":
        return Ref(val)
    if tag == "$float":
        return float(val)
    if tag == "$size":
        return torch.Size(val)
    if tag == "$tuple":
        return tuple(decode(x) for x in val)
    if tag == "$dict":
        return {decode(k): decode(v) for k, v in val}
    if tag == "$slice":
        return slice(*(decode(x) for x in val))
    if tag == "$ellipsis":
        return Ellipsis
    if tag == "$dtype":
        return getattr(torch, val)
    if tag == "$device":
        return torch.device(val)
    if tag == "$complex":
        return complex(*val)
    if tag == "$torch":
        return _TORCH_ENUMS[val]
    raise ValueError(f"unknown tag {tag} in graph data")
