"""How fully sharded data parallelism (``use_zero=3``) groups parameters into units: the rule the
runtime applies (`nnscaler.runtime.zero3`) and the policies' cost models price
(`nnscaler.policies.autodist`), so both see the same units."""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

__all__ = ["ROOT_UNIT", "unit_names"]

ROOT_UNIT = ""


def unit_names(full_names: Sequence[str], unit_modules: Sequence[str] = ()) -> Dict[str, str]:
    """full (single-device) parameter name -> its unit; ``""`` is the root unit.

    With `unit_modules` (``pas_config["zero3_units"]``, module paths): the longest path a name
    starts with, else the root. Otherwise each repeated block is a unit: the outermost
    ``<prefix>.<i>`` whose prefix holds at least two indices (``model.layers.0``, ``h.3``; an MoE
    layer's experts stay inside their decoder layer), as FSDP's auto-wrap of each decoder layer."""
    if unit_modules:
        prefixes = sorted(unit_modules, key=len, reverse=True)
        return {n: next((p for p in prefixes if n.startswith(p + ".")), ROOT_UNIT) for n in full_names}
    indices: Dict[Tuple[str, ...], set] = {}
    for name in full_names:
        parts = name.split(".")
        for i, part in enumerate(parts[:-1]):
            if part.isdigit():
                indices.setdefault(tuple(parts[:i]), set()).add(part)
    out = {}
    for name in full_names:
        parts = name.split(".")
        out[name] = next((".".join(parts[:i + 1]) for i, part in enumerate(parts[:-1])
                          if part.isdigit() and len(indices[tuple(parts[:i])]) > 1), ROOT_UNIT)
    return out
