"""The Python name of every value in one rank's generated module.

Parameters, buffers and constants become attributes named after their full names
(``layers.0.weight`` -> ``self.layers_0_weight``); the forward's arguments keep their names (a
tensor nested inside one is unpacked into a variable first); every op output gets a variable
named after its value and id. Names never shadow Python keywords, builtins or attributes of the
module (render.py `python_name`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from nnscaler.ir import IRGraph

from .render import python_name

__all__ = ["Naming", "name_values", "param_local_names"]


def param_local_names(graph: IRGraph) -> Dict[str, str]:
    """Full parameter/buffer/constant name -> attribute name in the generated module."""
    taken: set = set()
    return {spec.name: python_name(spec.name, taken) for spec in graph.tensor_specs()}


@dataclass
class Naming:
    local: Dict[str, str]  # full tensor name -> attribute name
    names: Dict[int, str] = field(default_factory=dict)  # value id -> Python expression
    taken: set = field(default_factory=set)  # identifiers in use (new ones are made fresh)
    arg_names: set = field(default_factory=set)  # the forward's argument names
    arg_lines: List[str] = field(default_factory=list)  # unpacking of tensors nested in arguments


def name_values(graph: IRGraph) -> Naming:
    local = param_local_names(graph)
    naming = Naming(local, taken=set(local.values()))
    names, taken = naming.names, naming.taken
    for spec in graph.tensor_specs():
        names[spec.value.id] = f"self.{local[spec.name]}"
    naming.arg_names = {i.name for i in graph.inputs}
    taken |= naming.arg_names | {"_acts", "_vals"}
    for inp in graph.inputs:
        for path, ref in inp.leaves:
            if not path:
                names[ref.id] = inp.name
                continue
            var = python_name(inp.name + "_" + "_".join(str(p) for p in path), taken)
            names[ref.id] = var
            naming.arg_lines.append(f"{var} = {inp.name}" + "".join(f"[{p!r}]" for p in path))
    for node in graph.nodes:
        for ref in node.output_refs():
            names[ref.id] = python_name(f"{graph.value(ref).name}_{ref.id}", taken)
    return naming
