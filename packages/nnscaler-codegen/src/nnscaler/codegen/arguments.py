"""The generated forward's arguments: its signature, and the checks on arguments traced without a value."""
from __future__ import annotations

from typing import List

from nnscaler.ir import IRGraph, decode

from .input_checks import input_checks
from .render import Renderer


def forward_signature(graph: IRGraph) -> str:
    parts, star_done = [], False
    for inp in graph.inputs:
        if inp.kind == "VAR_POSITIONAL":
            parts.append(f"*{inp.name}")
            star_done = True
        elif inp.kind == "VAR_KEYWORD":
            parts.append(f"**{inp.name}")
        else:
            if inp.kind == "KEYWORD_ONLY" and not star_done:
                parts.append("*")
                star_done = True
            if inp.has_default:
                parts.append(f"{inp.name}={Renderer({}).value(decode(inp.default))}")
            else:
                parts.append(inp.name)
    return ", ".join(parts)


def untraced_checks(graph: IRGraph) -> List[str]:
    """The checks at the top of the generated forward: arguments that had no dummy value (the
    generated code ran with their default, so refuse others), then the tensor arguments' schema
    (`input_checks`: shapes and dtypes under constant folding, else ranks)."""
    lines = []
    for inp in graph.inputs:
        if inp.traced or not inp.has_default or inp.kind.startswith("VAR_"):
            continue
        if decode(inp.default) is None:
            lines.append(f"if {inp.name} is not None:")
            lines.append(f"    raise TypeError(\"argument {inp.name!s} was not in dummy_forward_args when the "
                         f"model was traced, so the generated code only supports its default (None); "
                         f"trace with a value for it\")")
    return lines + input_checks(graph)
